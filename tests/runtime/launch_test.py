"""semijax.runtime.launch (local multi-process jobs) and semijax.runtime.contention (a CPU
competitor).

Children are real processes; every test checks that none is left behind.
"""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers import ROOT
from semijax.runtime import contention
from semijax.runtime import launch
from semijax.train import metrics

PY = sys.executable
TICK = os.sysconf("SC_CLK_TCK")
CORE = min(os.sched_getaffinity(0))
TINY = {"model.seq_len": 16, "model.d_model": 32, "model.num_heads": 8, "model.d_ff": 64,
        "model.num_layers": 1, "layout.num_widths": 2, "batch_size": 8, "steps": 3,
        "log_every": 1, "eval_every": 3, "checkpoint_every": 3, "data.eval_batches": 1,
        "optimizer.warmup_steps": 1}


def alive(pid: int) -> bool:
  """True if `pid` exists and is not a zombie."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except FileNotFoundError:
    return False


def cpu_s(pid: int) -> float:
  """User + system CPU seconds of `pid` (/proc/<pid>/stat utime, stime)."""
  with open(f"/proc/{pid}/stat") as f:
    fields = f.read().rsplit(")", 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / TICK


def by_process(*code: str) -> list[str]:
  """argv of a Python child that prints its pid, then runs code[i] in process i."""
  branches = "\n".join(f"{'elif' if i else 'if'} i == {i}: {c}" for i, c in enumerate(code))
  return [PY, "-c", "import os, subprocess, sys, time\n"
          "i = int(os.environ['SEMIJAX_PROCESS_ID'])\n"
          "print('pid', os.getpid(), flush=True)\n" + branches]


def logged_pids(log_dir) -> list[int]:
  return [int(line.split()[1]) for name in sorted(os.listdir(log_dir))
          for line in open(os.path.join(log_dir, name)) if line.startswith("pid ")]


# --- launch -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_process_training_run(tmp_path):
  # Processes split the batch rows (data axis), so the 2x2 mesh spans both: data=2, tensor=2.
  argv = [PY, os.path.join(ROOT, "experiments", "train.py"),
          "--config", os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=2,data=2"),
          "--workdir", str(tmp_path / "work")] + [f"--config.{k}={v}" for k, v in TINY.items()]
  cores = sorted(os.sched_getaffinity(0))
  result = launch.launch(argv, 2, cores=[cores[:1], cores[-1:]],
                         devices_per_process=2, env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "true"},
                         timeout_s=240, log_dir=str(tmp_path / "logs"))
  assert result.returncodes == [0, 0], result.failure_message() or open(
      result.log_paths[1]).read()[-3000:]
  records = metrics.read_jsonl(str(tmp_path / "work" / "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2, 3]
  assert np.all(np.isfinite([r["train/loss"] for r in records]))
  assert "process 0 of 2, 4 devices (2 local)" in open(result.log_paths[0]).read()
  assert not any(alive(p) for p in result.pids)


@pytest.mark.slow
def test_two_process_semi_run_shares_its_decisions(tmp_path):
  # The benchmark's shape: one device per process on its own core, tensor = 2 across processes
  # (every process feeds the whole batch). Speeds come from each process's scheduler share and
  # are shared, so both take the same decisions; a divergence would hang a collective.
  overrides = dict(TINY, **{"balance.policy": "semi", "balance.probe_every": 1, "steps": 6,
                            "balance.num_widths": 4})
  argv = [PY, os.path.join(ROOT, "experiments", "train.py"),
          "--config", os.path.join(ROOT, "configs", "gpt_tiny.py:cpu,tensor=2"),
          "--workdir", str(tmp_path / "work")] + [f"--config.{k}={v}" for k, v in overrides.items()]
  cores = sorted(os.sched_getaffinity(0))
  result = launch.launch(argv, 2, cores=[cores[:1], cores[-1:]], devices_per_process=1,
                         env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "true"}, timeout_s=300,
                         log_dir=str(tmp_path / "logs"))
  assert result.returncodes == [0, 0], result.failure_message() or open(
      result.log_paths[1]).read()[-3000:]
  records = metrics.read_jsonl(str(tmp_path / "work" / "metrics.jsonl"))
  assert [r["step"] for r in records] == list(range(1, 7))
  decisions = metrics.read_jsonl(str(tmp_path / "work" / "decisions.jsonl"))
  assert len(decisions) >= 4
  assert all(len(d["speeds"]) == 2 and 0 < min(d["speeds"]) <= 1 for d in decisions)
  assert all(d["measured_s"] > 0 and "current" in d["predicted_s"] for d in decisions)


def test_a_failure_stops_the_others(tmp_path):
  # Process 0 also starts a grandchild: the whole process group must go, not just the leader.
  argv = by_process("g = subprocess.Popen(['sleep', '60']); print('pid', g.pid, flush=True); "
                    "time.sleep(60)", "time.sleep(0.5); sys.exit(3)")
  start = time.monotonic()
  result = launch.launch(argv, 2, log_dir=str(tmp_path), grace_s=2, timeout_s=60)
  assert time.monotonic() - start < 15
  assert not result.ok and result.failed == 1
  assert result.returncodes[1] == 3 and result.returncodes[0] != 0
  assert "process 1 exited with code 3" in result.failure_message()
  assert "pid" in result.failure_tail
  pids = logged_pids(tmp_path)
  assert len(pids) == 3 and set(result.pids) < set(pids)
  assert not any(alive(p) for p in pids)


def test_timeout_kills_all(tmp_path):
  argv = by_process("time.sleep(60)", "time.sleep(60)")
  start = time.monotonic()
  with pytest.raises(TimeoutError, match=r"processes \[0, 1\] still running after timeout_s=1"):
    launch.launch(argv, 2, log_dir=str(tmp_path), timeout_s=1, grace_s=1)
  assert time.monotonic() - start < 10
  pids = logged_pids(tmp_path)
  assert len(pids) == 2 and not any(alive(p) for p in pids)


def test_children_get_cores_and_environment(tmp_path):
  cores = sorted(os.sched_getaffinity(0))
  cores = [cores[:1], cores[-1:]]
  code = ("print(sorted(os.sched_getaffinity(0)), os.environ['SEMIJAX_NUM_PROCESSES'], "
          "os.environ['SEMIJAX_COORDINATOR'], os.environ['JAX_PLATFORMS'], "
          "os.environ['XLA_FLAGS'], os.getpgid(0) == os.getpid(), sep='|')")
  result = launch.launch(by_process(code, code), 2, cores=cores, devices_per_process=3,
                         env={"XLA_FLAGS": "--xla_dump_to=/tmp/x "
                                           "--xla_force_host_platform_device_count=8"},
                         log_dir=str(tmp_path), timeout_s=30)
  assert result.ok, result.failure_message()
  coordinators = set()
  for i in range(2):
    line = open(result.log_paths[i]).read().splitlines()[1].split("|")
    assert line[0] == str(cores[i])
    assert line[1] == "2" and line[3] == "cpu" and line[5] == "True"
    assert line[4] == "--xla_dump_to=/tmp/x --xla_force_host_platform_device_count=3"
    coordinators.add(line[2])
  (coordinator,) = coordinators
  assert coordinator.startswith("127.0.0.1:")


@pytest.mark.parametrize("kwargs, name", [
    ({"argv": []}, "argv"),
    ({"num_processes": 0}, "num_processes"),
    ({"cores": [[0]]}, "cores"),
    ({"cores": [[0], [4096]]}, r"cores\[1\]"),
    ({"cores": [[0], []]}, r"cores\[1\]"),
    ({"devices_per_process": 0}, "devices_per_process"),
    ({"timeout_s": 0}, "timeout_s"),
])
def test_bad_launch_arguments(kwargs, name, monkeypatch):
  def no_start(*args, **kw):
    raise AssertionError("a process was started")
  monkeypatch.setattr(launch.subprocess, "Popen", no_start)
  args = {"argv": ["true"], "num_processes": 2, **kwargs}
  if "cores" in kwargs:   # core 0 may not be ours: use the first available one
    args["cores"] = [[CORE if c == 0 else c for c in cs] for cs in kwargs["cores"]]
  with pytest.raises(ValueError, match=f"^{name}:"):
    launch.launch(args.pop("argv"), args.pop("num_processes"), **args)


def test_flag_helpers():
  assert launch.parse_cores("0,1:2,3") == [[0, 1], [2, 3]]
  assert launch.parse_cores("0:1") == [[0], [1]]
  with pytest.raises(ValueError, match="--cores"):
    launch.parse_cores("0:")
  assert launch.with_device_count("", 2) == "--xla_force_host_platform_device_count=2"
  assert launch.with_device_count("--a=1 --xla_force_host_platform_device_count=8 --b", 1) == (
      "--a=1 --b --xla_force_host_platform_device_count=1")


def test_command_line_reports_failure(tmp_path):
  cmd = [PY, "-m", "semijax.runtime.launch", "--num_processes=2", f"--log_dir={tmp_path}",
         "--grace_s=1", "--"] + by_process("time.sleep(30)", "sys.exit(3)")
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert done.returncode == 1
  assert "process 1 exited with code 3" in done.stderr
  assert not any(alive(p) for p in logged_pids(tmp_path))


# --- contention ---------------------------------------------------------------------------------


def test_steady_competitor_burns_its_core():
  inj = contention.Injector(CORE)
  with inj:
    pid = inj.pid
    assert os.sched_getaffinity(pid) == {CORE}
    time.sleep(0.1)   # let it get past interpreter start-up
    c0, t0 = cpu_s(pid), time.monotonic()
    time.sleep(1.0)
    used, wall = cpu_s(pid) - c0, time.monotonic() - t0
  # A whole core when the machine is idle; other jobs on a shared machine may take some of it.
  assert used >= 0.4 * wall, (used, wall)
  assert not alive(pid)
  assert inj.intervals() == [(0.0, pytest.approx(1.1, abs=0.3))]
  inj.stop()   # idempotent
  assert not alive(pid)


def test_bursts_follow_the_schedule():
  inj = contention.Injector(CORE, "bursts", on_s=0.5, off_s=0.5)
  samples = []
  with inj:
    pid, start = inj.pid, time.monotonic()
    for t in (0.1, 0.4, 0.6, 0.9, 1.1, 1.4, 1.6, 1.9):   # pairs inside on, off, on, off phases
      time.sleep(max(0.0, t - (time.monotonic() - start)))
      samples.append(cpu_s(pid))
    time.sleep(max(0.0, 2.2 - (time.monotonic() - start)))
  on = [samples[1] - samples[0], samples[5] - samples[4]]
  off = [samples[3] - samples[2], samples[7] - samples[6]]
  assert min(on) >= 0.1, (on, off)     # of 0.3 s; more unless the machine is busy
  assert max(off) <= 0.03, (on, off)   # a stopped process gets no CPU (tick = 10 ms)
  assert not alive(pid)
  got = inj.intervals()
  assert len(got) == 3
  np.testing.assert_allclose(got[:2], [(0.0, 0.5), (1.0, 1.5)], atol=0.1)
  assert got[2][0] == pytest.approx(2.0, abs=0.1) and got[2][1] == pytest.approx(2.2, abs=0.15)
  assert [inj.is_on(t) for t in (-0.1, 0.25, 0.75, 1.25, 1.75, 10.25)] == [
      False, True, False, True, False, True]
  described = json.loads(json.dumps(inj.to_json()))
  assert described["pattern"] == "bursts" and described["intervals"] == [list(i) for i in got]


def test_random_schedule_is_seeded_and_none_does_nothing():
  plan = lambda seed, start_on=True: [
      contention.Injector(CORE, "random", on_s=1, off_s=2, seed=seed,
                          start_on=start_on).is_on(t / 10) for t in range(300)]
  a = plan(0)
  assert a == plan(0) and a != plan(1)
  assert a[0] and not plan(0, start_on=False)[0]
  assert 0.15 < np.mean(a) < 0.55   # on ~1/3 of the time
  with contention.Injector(CORE, "none") as inj:
    assert inj.pid is None
  assert inj.intervals() == [] and not inj.is_on(1.0)


@pytest.mark.parametrize("kwargs, name", [
    ({"pattern": "sometimes"}, "pattern"),
    ({"core": 4096}, "core"),
    ({"on_s": 0}, "on_s"),
    ({"off_s": -1}, "off_s"),
])
def test_bad_injector_arguments(kwargs, name, monkeypatch):
  def no_start(*args, **kw):
    raise AssertionError("a process was started")
  monkeypatch.setattr(contention.subprocess, "Popen", no_start)
  with pytest.raises(ValueError, match=f"^{name}:"):
    contention.Injector(**{"core": CORE, **kwargs}).start()
