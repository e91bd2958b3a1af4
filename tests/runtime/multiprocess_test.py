"""The training entry point as a 2-process job (jax.distributed on 127.0.0.1, gloo collectives).

Each process has 4 CPU devices; the 2x4 (data x tensor) mesh spans both, each process feeding
its rows of the global batch. The losses must match the same config run in one process on 8
devices, also for a run stopped by SIGTERM whose newest checkpoints were then damaged, and for a
pipeline of one stage per process, also resuming a one-process unpipelined run's checkpoint.
"""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import helpers as H
from helpers import ROOT, tiny_gpt
from semijax.runtime import launch
from semijax.train import loop as train
from semijax.train import metrics

OVERRIDES = {"model.seq_len": 16, "model.d_model": 32, "model.num_heads": 8, "model.d_ff": 64,
             "model.num_layers": 1, "layout.num_widths": 2, "batch_size": 8, "steps": 4,
             "eval_every": 2, "log_every": 1, "checkpoint_every": 2, "data.eval_batches": 1,
             "optimizer.warmup_steps": 2, "layout.mlp": "(10,30,4,20)", "layout.heads": "3,1,2,2"}
TIMEOUT_S = 300


@pytest.mark.slow
def test_two_processes_match_one_process(tmp_path):
  workdir = tmp_path / "multi"
  cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"), "--verbosity=0",
         "--config", os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=4,data=2"),
         "--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in OVERRIDES.items()]
  result = launch.launch(cmd, 2, devices_per_process=4, timeout_s=TIMEOUT_S,
                         log_dir=str(tmp_path))
  assert result.returncodes == [0, 0], (result.failure_message() or
                                        open(result.log_paths[0]).read()[-3000:])
  found = []
  for i, path in enumerate(result.log_paths):
    with open(path) as f:
      log = f.read()
    assert f"process {i} of 2, 8 devices (4 local)" in log, path
    if sys.platform.startswith("linux"):
      # After the warm-up each process looks for gloo's event-loop threads (blocked in epoll)
      # and gives every one it finds nice 19.
      ((tids, nice),) = re.findall(
          r"collectives' transport threads \[([\d, ]*)\] now at nice \[(\d*)\]", log)
      assert nice == ("19" if tids else ""), (path, tids, nice)
      found.append(tids)
  # A process reads its threads 5 times in 8 ms, and a loop still waiting for a core on a loaded
  # machine is missed then: one of the two must find its loop (core/transport_test.py checks the
  # finding and the nice value on a real epoll thread of its own).
  assert not found or any(found), "no process found a transport thread"

  config = tiny_gpt(tensor=4, steps=4, mlp=(10, 30, 4, 20), heads=(3, 1, 2, 2))
  config.mesh.data = 2
  config.eval_every, config.checkpoint_every = 2, 2
  single = train.train_and_evaluate(config, str(tmp_path / "single"))
  records = metrics.read_jsonl(str(workdir / "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2, 3, 4]          # process 0 wrote, once
  np.testing.assert_allclose([r["train/loss"] for r in records], single["losses"], rtol=2e-6)
  np.testing.assert_allclose(records[-1]["val/loss"], single["val/loss"], rtol=2e-6)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["2", "4"]


@pytest.mark.slow
def test_pipeline_across_two_processes_matches_one_process(tmp_path):
  # Stage 0 on process 0's four devices, stage 1 on process 1's: activations and cotangents
  # cross the processes by ppermute (gloo), the replicated parameters' gradients by psum.
  config = tiny_gpt(tensor=4, steps=4, mlp=(10, 30, 4, 20), heads=(3, 1, 2, 2))
  config.model.num_layers = 2
  config.eval_every, config.checkpoint_every = 2, 2
  single = train.train_and_evaluate(config, str(tmp_path / "single"))
  # The unpipelined run's checkpoint 2, resumed by the pipeline: each process reads only its
  # own stage's block.
  shutil.copytree(tmp_path / "single", tmp_path / "from_flat")
  shutil.rmtree(tmp_path / "from_flat" / "checkpoints" / "4")
  overrides = dict(OVERRIDES, **{"model.num_layers": 2, "mesh.pipe": 2,
                                 "pipeline.microbatches": 2, "pipeline.layers": "1,1"})
  for name in ("multi", "from_flat"):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
           "--config", os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=4"),
           "--workdir", str(tmp_path / name)] + [f"--config.{k}={v}"
                                                 for k, v in overrides.items()]
    result = launch.launch(cmd, 2, devices_per_process=4, timeout_s=TIMEOUT_S,
                           log_dir=str(tmp_path / f"{name}_logs"))
    assert result.returncodes == [0, 0], (result.failure_message() or
                                          open(result.log_paths[0]).read()[-3000:])
  records = metrics.read_jsonl(str(tmp_path / "multi" / "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["train/loss"] for r in records], single["losses"], rtol=2e-5)
  np.testing.assert_allclose(records[-1]["val/loss"], single["val/loss"], rtol=2e-5)
  assert sorted(os.listdir(tmp_path / "multi" / "checkpoints")) == ["2", "4"]
  resumed = [r for r in metrics.read_jsonl(str(tmp_path / "from_flat" / "metrics.jsonl"))
             if "train/loss" in r]
  assert [r["step"] for r in resumed] == [1, 2, 3, 4]
  np.testing.assert_allclose([r["train/loss"] for r in resumed[2:]], single["losses"][2:],
                             rtol=2e-5)


def train_command(workdir, **overrides):
  return [sys.executable, os.path.join(ROOT, "experiments", "train.py"),
          "--config", os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=4,data=2"),
          "--workdir", str(workdir)] + [f"--config.{k}={v}"
                                        for k, v in dict(OVERRIDES, **overrides).items()]


@pytest.mark.slow
def test_sigterm_stops_both_processes_at_one_step_and_damaged_ones_are_skipped(tmp_path):
  steps = 40
  workdir, logs = tmp_path / "multi", tmp_path / "logs"
  # A checkpoint every step, six kept: the five newest are damaged below, one way each.
  overrides = {"steps": steps, "eval_every": 20, "checkpoint_every": 1, "keep_checkpoints": 6}
  launcher = subprocess.Popen(
      [sys.executable, "-m", "semijax.runtime.launch", "--num_processes=2",
       "--devices_per_process=4", f"--log_dir={logs}", f"--timeout_s={TIMEOUT_S}", "--"] +
      train_command(workdir, **overrides), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True, env=dict(os.environ, PYTHONPATH=ROOT))
  path, deadline = workdir / "metrics.jsonl", time.monotonic() + TIMEOUT_S
  while not (path.exists() and len(path.read_text().splitlines()) >= 6):
    assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
    time.sleep(0.02)
  launcher.send_signal(signal.SIGTERM)              # as a scheduler would, after step 6
  out, err = launcher.communicate(timeout=TIMEOUT_S)
  assert launcher.returncode == 0, err
  (stop,) = map(int, re.findall(r"^\[0\] preempted at step (\d+)", out, re.M))
  assert 6 <= stop < steps
  # Saving is collective: the checkpoint of that step is committed only if both processes
  # stopped at it (and both exited 0).
  saved = sorted(map(int, os.listdir(workdir / "checkpoints")))
  assert saved == list(range(stop - 5, stop + 1))
  assert (workdir / "checkpoints" / str(stop) / "semijax_checksums.json").exists()

  damaged = dict(zip(reversed(saved), sorted(H.CHECKPOINT_DAMAGE)))   # step -> damage
  for step, damage in damaged.items():
    H.CHECKPOINT_DAMAGE[damage][0](str(workdir / "checkpoints" / str(step)))
  result = launch.launch(train_command(workdir, **dict(overrides, checkpoint_every=10)), 2,
                         devices_per_process=4, timeout_s=TIMEOUT_S,
                         log_dir=str(tmp_path / "rerun"))
  assert result.returncodes == [0, 0], result.failure_message()
  log = open(result.log_paths[0]).read()
  for step, damage in damaged.items():
    said = H.CHECKPOINT_DAMAGE[damage][1]
    assert re.search(rf"checkpoint step {step} in \S+ is damaged \(.*{said}.*\): not loaded, "
                     rf"set aside in \S+checkpoints.damaged/{step}\n", log), (damage, log)
  assert f"resumed from step {saved[0]} " in log
  assert sorted(map(int, os.listdir(workdir / "checkpoints.damaged"))) == saved[1:]   # kept

  config = tiny_gpt(tensor=4, steps=steps, mlp=(10, 30, 4, 20), heads=(3, 1, 2, 2))
  config.mesh.data = 2
  config.eval_every, config.checkpoint_every = 20, 10
  single = train.train_and_evaluate(config, str(tmp_path / "single"))
  records = metrics.read_jsonl(str(path))
  assert [r["step"] for r in records] == list(range(1, steps + 1))     # each step once
  np.testing.assert_allclose([r["train/loss"] for r in records], single["losses"], rtol=2e-6)
  np.testing.assert_allclose(records[-1]["val/loss"], single["val/loss"], rtol=2e-6)
