"""The replica modes with one replica per process: 2 processes of experiments/train.py joined by
jax.distributed (gloo), one CPU device each, the second sharing its core with a CPU-bound
competitor. Timing decides who is in which round, so the checks hold for any timing: every
microbatch of the budget is applied exactly once, no gradient is staler than the bound, every
process ends with the same model, and it learned."""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import ROOT
from semijax.core import mesh as mesh_lib
from semijax.runtime import contention
from semijax.runtime import launch
from semijax.sync import real
from semijax.train import metrics
from semijax.train import replica_processes

STEPS, BATCH = 6, 8
OVERRIDES = {"model.seq_len": 16, "model.d_model": 32, "model.num_heads": 4, "model.d_ff": 64,
             "model.num_layers": 1, "layout.num_widths": 1, "batch_size": BATCH,
             "steps": STEPS, "eval_every": 2, "log_every": 1, "checkpoint_every": 0,
             "data.eval_batches": 1, "optimizer.warmup_steps": 2, "sync.staleness_bound": 2,
             "sync.local_steps": 2}


def train_two_processes(tmp_path, mode):
  workdir = tmp_path / mode
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
         "--config", os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=1,data=2"),
         "--workdir", str(workdir), f"--config.sync.mode={mode}"]
  cmd += [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  cores = [[0], [1]] if len(launch.machine_cores()) >= 2 else None
  with contention.Injector(1 if cores else 0, "steady"):
    result = launch.launch(cmd, 2, cores=cores, devices_per_process=1, timeout_s=300,
                           log_dir=str(tmp_path / f"{mode}_logs"))
  assert result.ok, result.failure_message()
  with open(workdir / replica_processes.ROUNDS_NAME) as f:
    return json.load(f), metrics.read_jsonl(str(workdir / "metrics.jsonl"))


@pytest.mark.slow
def test_ssaw_in_two_processes_applies_every_microbatch_once(tmp_path):
  out, records = train_two_processes(tmp_path, "ssaw")
  rounds = out["rounds"]
  applied = sorted(j for r in rounds for j in r["microbatches"] if j >= 0)
  assert applied == list(range(STEPS * 2))
  assert max(s for r in rounds for s in r["staleness"]) <= 2
  assert rounds[-1]["members"] == [0, 1]          # the last round brings both to one model
  assert rounds[-1]["samples"] == STEPS * BATCH
  curve = out["curve"]
  assert curve[-1][1] == STEPS * BATCH and curve[-1][2] < curve[0][2]
  assert records[-1]["val/loss"] == pytest.approx(curve[-1][2])


@pytest.mark.slow
def test_local_sgd_in_two_processes(tmp_path):
  out, _ = train_two_processes(tmp_path, "local_sgd")
  assert [r["samples"] for r in out["rounds"]] == [BATCH * (k + 1) for k in range(STEPS)]
  curve = np.asarray(out["curve"])
  assert list(curve[:, 1]) == [2 * BATCH, 4 * BATCH, 6 * BATCH]   # evaluated at every average
  assert curve[-1, 2] < curve[0, 2]


def test_psum_packed_is_psum_in_one_all_reduce_per_dtype():
  mesh = mesh_lib.make_mesh(4, 2)
  tree = {"a": jnp.arange(4 * 6, dtype=jnp.float32).reshape(4, 6),
          "b": jnp.arange(4 * 2 * 3, dtype=jnp.float32).reshape(4, 2, 3),
          "n": jnp.arange(4, dtype=jnp.int32)}
  specs = {"a": P("data", "tensor"), "b": P("data", None, None), "n": P("data")}
  run = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(specs,), out_specs=specs,
                                        check_vma=False))(tree)
  packed = run(lambda t: real.psum_packed(t, "data"))
  expected = run(lambda t: jax.lax.psum(t, "data"))
  for k in tree:
    np.testing.assert_array_equal(np.asarray(packed[k]), np.asarray(expected[k]))
  hlo = jax.jit(jax.shard_map(lambda t: real.psum_packed(t, "data"), mesh=mesh, in_specs=(specs,),
                              out_specs=specs, check_vma=False)).lower(tree).as_text()
  assert hlo.count("all-reduce") == 2 or hlo.count("all_reduce") == 2
