"""The replica modes with one replica per process: 2 processes of experiments/train.py joined by
jax.distributed (gloo), one CPU device each, the second sharing its core with a CPU-bound
competitor. Each run is compared with the same config trained in ONE process, its two replicas
emulated on the `data` axis of 8 fake devices, by their validation losses (after every average,
or whenever the samples applied cross a multiple of eval_every batches, and at the end).
local_sgd does not depend on timing. In ssaw timing decides who is in which round, so the
one-process run replays the rounds the coordinator recorded (and every microbatch of the budget
must be applied exactly once, no gradient staler than the bound). A round of both replicas,
fresh on one global batch, is a synchronous step (the one-process run takes it as the engine's
train step when the microbatches are in replica order): at equal speeds every round is one, and
the reference is synchronous training."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers as H
from helpers import ROOT
from semijax.core import mesh as mesh_lib
from semijax.runtime import contention
from semijax.runtime import launch
from semijax.sync import real
from semijax.sync import timeline as timeline_lib
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics
from semijax.train import replica_processes

STEPS, BATCH = 6, 8
CONFIG = os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=1,data=2")
OVERRIDES = {"model.seq_len": 16, "model.d_model": 32, "model.num_heads": 4, "model.d_ff": 64,
             "model.num_layers": 1, "layout.num_widths": 1, "batch_size": BATCH,
             "steps": STEPS, "eval_every": 2, "log_every": 1, "checkpoint_every": 0,
             "data.eval_batches": 1, "optimizer.warmup_steps": 2, "sync.staleness_bound": 2,
             "sync.local_steps": 2, "optimizer.loss_scale": "dynamic",
             "optimizer.loss_scale_period": 2}
# Every run is under dynamic loss scaling, doubling every 2 finite steps from 2^15: a
# power-of-two scale is exact in float32, so it leaves the comparisons below as they were, and
# each process's gradients must be taken at its own state's scale and divided by it.
# The processes and the one-process run differ in summation order only (a replica's gradient
# vmapped over the data axis or not, a psum over processes or a sum over the axis): float32
# rounding carried through a few Adam steps, about 3e-7 of the validation loss.
RTOL = 1e-5
ENGINES: dict = {}       # the one-process runs of this module share an engine


def train_command(workdir, mode, **overrides):
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
         "--config", CONFIG, "--workdir", str(workdir), f"--config.sync.mode={mode}"]
  return cmd + [f"--config.{k}={v}" for k, v in dict(OVERRIDES, **overrides).items()]


def train_two_processes(tmp_path, mode):
  workdir = tmp_path / mode
  cmd = train_command(workdir, mode)
  cores = [[0], [1]] if len(launch.machine_cores()) >= 2 else None
  with contention.Injector(1 if cores else 0, "steady"):
    result = launch.launch(cmd, 2, cores=cores, devices_per_process=1, timeout_s=300,
                           log_dir=str(tmp_path / f"{mode}_logs"))
  assert result.ok, result.failure_message()
  with open(workdir / replica_processes.ROUNDS_NAME) as f:
    return json.load(f), metrics.read_jsonl(str(workdir / "metrics.jsonl"))


def train_one_process(workdir, mode):
  """The same config in this process: two emulated replicas on 2 of the 8 fake devices."""
  c = config_lib.load(CONFIG)
  c.sync.mode = mode
  for key, value in OVERRIDES.items():
    node, _, field = key.rpartition(".")
    (c[node] if node else c)[field] = value
  return train.train_and_evaluate(c, str(workdir), engine_cache=ENGINES)


class RecordedRounds(timeline_lib.Timeline):
  """A `Timeline` whose rounds are given: a multi-process run's recorded ones (each replica
  claims the microbatches it computed there, in order; a member without one, at the end of the
  stream, only received the state and is left out)."""

  def __init__(self, rounds, *args):
    super().__init__(*args)
    self.recorded = rounds
    self.queues = [[j for rnd in rounds for i, j in zip(rnd["members"], rnd["microbatches"])
                    if i == r and j >= 0] for r in range(self.num_replicas)]

  def start(self, durations, delay_s=0.0):
    claims = []
    for r, queue in enumerate(self.queues):
      if self.work[r] is None and queue:
        j = queue.pop(0)
        self.work[r] = timeline_lib.Work(j, self.version, 0.0, 0.0, self.microbatch_samples)
        claims.append((r, j))
        self.next_microbatch += 1
    return claims

  def peek(self):
    if self.version == len(self.recorded):
      return None
    rnd = self.recorded[self.version]
    members = tuple(i for i, j in zip(rnd["members"], rnd["microbatches"]) if j >= 0)
    staleness = tuple(self.version - self.work[i].base for i in members)
    # what the coordinator recorded is what the replicas computed on
    assert staleness == tuple(s for s, j in zip(rnd["staleness"], rnd["microbatches"])
                              if j >= 0), (rnd, staleness)
    return timeline_lib.Round(self.version + 1, float(self.version), float(self.version + 1),
                              members, tuple(self.work[i].microbatch for i in members),
                              staleness, tuple(self.work[i].samples for i in members))


def assert_same_curve(multi, single):
  """The validation curves (samples applied, val loss) of a multi- and a one-process run."""
  assert [p[1] for p in multi] == [p[1] for p in single]
  np.testing.assert_allclose([p[2] for p in multi], [p[2] for p in single], rtol=RTOL)


@pytest.mark.slow
def test_ssaw_in_two_processes_matches_its_rounds_in_one_process(tmp_path, monkeypatch):
  out, records = train_two_processes(tmp_path, "ssaw")
  rounds = out["rounds"]
  applied = sorted(j for r in rounds for j in r["microbatches"] if j >= 0)
  assert applied == list(range(STEPS * 2))
  assert max(s for r in rounds for s in r["staleness"]) <= 2
  assert rounds[-1]["members"] == [0, 1]          # the last round brings both to one model
  assert rounds[-1]["samples"] == STEPS * BATCH
  curve = out["curve"]
  assert curve[-1][1] == STEPS * BATCH
  assert records[-1]["val/loss"] == pytest.approx(curve[-1][2])
  # Process 0's records: each of its updates once, up to the first that ends the budget (the
  # rounds after it only hand out the final state, within that step).
  mine = []
  for r in rounds:
    if 0 in r["members"]:
      mine.append(r)
      if r["samples"] == STEPS * BATCH:
        break
  assert [r["step"] for r in records] == list(range(1, len(mine) + 1))
  assert records[-1]["sync/samples"] == STEPS * BATCH
  scales = np.log2([r["train/loss_scale"] for r in records])    # before each of its updates
  assert scales[0] == 15 and scales[-1] > 15 and np.all(np.diff(scales) >= 0)
  assert np.all(scales == np.round(scales))

  monkeypatch.setattr(timeline_lib, "Timeline",
                      lambda *args: RecordedRounds(rounds, *args))
  single = train_one_process(tmp_path / "ssaw_one", "ssaw")
  assert single["steps"] == len(rounds)
  assert_same_curve(curve, single["sync"]["curve"])
  np.testing.assert_allclose(records[-1]["val/loss"], single["val/loss"], rtol=RTOL)


@pytest.mark.slow
def test_local_sgd_in_two_processes_matches_one_process(tmp_path):
  out, records = train_two_processes(tmp_path, "local_sgd")
  assert [r["samples"] for r in out["rounds"]] == [BATCH * (k + 1) for k in range(STEPS)]
  curve = out["curve"]
  assert [p[1] for p in curve] == [2 * BATCH, 4 * BATCH, 6 * BATCH]   # evaluated at every average
  assert [r["step"] for r in records] == list(range(1, STEPS + 1))     # every local step once
  assert all(np.isfinite(r["train/loss"]) for r in records)
  assert [r["train/loss_scale"] for r in records] == [2.0 ** (15 + i // 2) for i in range(STEPS)]
  single = train_one_process(tmp_path / "local_sgd_one", "local_sgd")
  assert_same_curve(curve, single["sync"]["curve"])
  np.testing.assert_allclose(records[-1]["val/loss"], single["val/loss"], rtol=RTOL)


# ssaw with staleness bound 0 makes every round one of both replicas: the model is then the
# same whoever claims which microbatch (a sum of two is the same either way), so an
# uninterrupted run is a reference to the step; at a bound > 0 the wall clock picks the rounds.
# sync: the data-parallel step over both processes (the reference for the others).
RESUMED = {"sync": {}, "local_sgd": {}, "ssaw": {"sync.staleness_bound": 0}}


def launch_in_background(cmd, log_dir):
  """The launcher as a scheduler runs it, in its own process (it forwards a SIGTERM)."""
  return subprocess.Popen(
      [sys.executable, "-m", "semijax.runtime.launch", "--num_processes=2",
       "--devices_per_process=1", f"--log_dir={log_dir}", "--timeout_s=300", "--"] + cmd,
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
      env=dict(os.environ, PYTHONPATH=ROOT))


def wait_for(launcher, ready):
  deadline = time.monotonic() + 300
  while not ready():
    assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
    time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds process 1 through /proc")
@pytest.mark.parametrize("mode", sorted(RESUMED))
def test_two_processes_resume_exactly_after_a_kill_and_a_sigterm(tmp_path, mode):
  # sync and local_sgd (local_steps 2) save every 3 steps, local_sgd's between averages: each
  # replica's own parameters and optimizer state, the momentum and the center must all come
  # back. ssaw saves at the cuts its coordinator makes once 3 batches more were applied
  # (versions 4, 7, ...). Process 1 is killed after step 5; the rerun is stopped by a SIGTERM
  # to the launcher; the third run finishes. The SIGTERM must land before the resumed run's
  # last step: JAX's preemption service takes a while to agree on a step, in which tiny steps
  # (about 50 ms) ran 9 steps to the end of a 14-step run in CI; 24 steps leave 19.
  steps = 24
  overrides = dict(RESUMED[mode], steps=steps, checkpoint_every=3, eval_every=4)
  reference = launch.launch(train_command(tmp_path / "whole", mode, **overrides), 2,
                            devices_per_process=1, timeout_s=300, log_dir=str(tmp_path / "w"))
  assert reference.ok, reference.failure_message()

  workdir = tmp_path / "run"
  cmd = train_command(workdir, mode, **overrides)
  path = workdir / "metrics.jsonl"
  lines = lambda: len(path.read_text().splitlines()) if path.exists() else 0
  launcher = launch_in_background(cmd, tmp_path / "k")
  wait_for(launcher, lambda: lines() >= 5)
  os.kill(H.job_process_pid(str(workdir), 1), signal.SIGKILL)
  launcher.communicate(timeout=300)
  assert launcher.returncode != 0                  # the job stopped as a whole
  # A save the kill interrupted leaves an orbax temporary folder ("7.orbax-checkpoint-tmp"),
  # which is not a checkpoint: resuming ignores it.
  killed_at = max(int(n) for n in os.listdir(workdir / "checkpoints") if n.isdigit())
  assert killed_at in ((4, 7) if mode == "ssaw" else (3, 6))

  launcher = launch_in_background(cmd, tmp_path / "t")
  log = tmp_path / "t" / "process0.log"
  wait_for(launcher, lambda: (log.exists() and f"resumed from step {killed_at} " in
                              log.read_text() and lines() >= killed_at + 2))
  launcher.send_signal(signal.SIGTERM)
  out, err = launcher.communicate(timeout=300)
  assert launcher.returncode == 0, err
  (stopped_at,) = map(int, re.findall(r"^\[0\] preempted at step (\d+)", out, re.M))
  assert killed_at < stopped_at < steps
  assert f"checkpoints/{stopped_at}; rerun" in out

  rerun = launch.launch(cmd, 2, devices_per_process=1, timeout_s=300,
                        log_dir=str(tmp_path / "r"))
  assert rerun.ok, rerun.failure_message()
  assert f"resumed from step {stopped_at} " in open(rerun.log_paths[0]).read()
  records = metrics.read_jsonl(str(path))
  whole = metrics.read_jsonl(str(tmp_path / "whole" / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(1, steps + 1))    # every update once
  if mode != "ssaw":        # (an ssaw replica's loss is of the microbatch it happened to claim)
    np.testing.assert_allclose([r["train/loss"] for r in records],
                               [r["train/loss"] for r in whole], rtol=1e-6)
  np.testing.assert_allclose(records[-1]["val/loss"], whole[-1]["val/loss"], rtol=1e-6)
  if mode == "sync":
    return
  with open(workdir / replica_processes.ROUNDS_NAME) as f:
    out = json.load(f)
  with open(tmp_path / "whole" / replica_processes.ROUNDS_NAME) as f:
    expected = json.load(f)
  assert [r["samples"] for r in out["rounds"]] == [BATCH * (k + 1) for k in range(steps)]
  if mode == "ssaw":        # every microbatch applied once, across the kill and the stop
    assert sorted(j for r in out["rounds"] for j in r["microbatches"]) == list(range(2 * steps))
  assert [p[1] for p in out["curve"]] == [p[1] for p in expected["curve"]]
  np.testing.assert_allclose([p[2] for p in out["curve"]], [p[2] for p in expected["curve"]],
                             rtol=1e-6)


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
