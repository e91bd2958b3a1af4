"""semijax.runtime.launch (local multi-process jobs) and semijax.runtime.contention (a CPU
competitor).

Children are real processes; every test checks that none is left behind.
"""

import json
import os
import signal
import subprocess
import sys
import time
import warnings

import jax
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
                         timeout_s=300, log_dir=str(tmp_path / "logs"))
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
    ({"platform": "tpu"}, "platform"),
    ({"platform": "gpu", "devices_per_process": 2, "env": {"CUDA_VISIBLE_DEVICES": "0,1,2"}},
     r"devices_per_process: 2 processes x 2 GPUs need 4, but 3 are visible \(0, 1, 2\)$"),
])
def test_bad_launch_arguments(kwargs, name, monkeypatch):
  def no_start(*args, **kw):
    raise AssertionError("a process was started")
  monkeypatch.setattr(launch.subprocess, "Popen", no_start)
  args = {"argv": ["true"], "num_processes": 2, **kwargs}
  if "cores" in kwargs:   # core 0 may not be ours: use the first available one
    args["cores"] = [[CORE if c == 0 else c for c in cs] for cs in kwargs["cores"]]
  with pytest.raises(ValueError, match=f"^{name}" + ("" if name.endswith("$") else ":")):
    launch.launch(args.pop("argv"), args.pop("num_processes"), **args)


def test_gpu_processes_each_get_their_own_gpus(tmp_path, monkeypatch):
  # The launcher's own CUDA_VISIBLE_DEVICES is what it hands out, in order.
  monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
  assert launch.visible_gpus() == ["3", "5", "6", "7"]
  base = {"XLA_FLAGS": "--a=1", "JAX_PLATFORMS": "cpu"}
  envs = [launch.child_env(base, i, "gpu", 2, launch.visible_gpus()) for i in range(2)]
  assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["3,5", "6,7"]
  assert all(e["JAX_PLATFORMS"] == "cuda" and e["XLA_FLAGS"] == "--a=1" for e in envs)
  assert [e["SEMIJAX_PROCESS_ID"] for e in envs] == ["0", "1"]
  cpu = launch.child_env(base, 1, "cpu", 3)
  assert cpu["JAX_PLATFORMS"] == "cpu" and "CUDA_VISIBLE_DEVICES" not in base
  assert cpu["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=3"
  # Without CUDA_VISIBLE_DEVICES: one index per GPU the driver lists.
  monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
  gpus = tmp_path / "gpus"
  for bus in ("0000:1b:00.0", "0000:43:00.0"):
    (gpus / bus).mkdir(parents=True)
  monkeypatch.setattr(launch, "_NVIDIA_GPUS", str(gpus))
  assert launch.visible_gpus() == ["0", "1"]
  monkeypatch.setattr(launch, "_NVIDIA_GPUS", str(tmp_path / "no_driver"))
  assert launch.visible_gpus() == []
  # Launched: every child sees its own GPUs (no GPU is touched: the children only print).
  code = "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['JAX_PLATFORMS'], sep='|')"
  result = launch.launch(by_process(code, code), 2, devices_per_process=1, platform="gpu",
                         env={"CUDA_VISIBLE_DEVICES": "4,2"}, log_dir=str(tmp_path / "logs"),
                         timeout_s=30)
  assert result.ok, result.failure_message()
  got = [open(p).read().splitlines()[1] for p in result.log_paths]
  assert got == ["4|cuda", "2|cuda"]


def test_spawning_from_a_jax_process_warns_of_no_fork(tmp_path):
  jax.numpy.ones(2).block_until_ready()     # JAX's backend and its threads are up
  out = tmp_path / "affinity"
  argv = [sys.executable, "-c",
          f"import os; open({str(out)!r}, 'w').write(str(sorted(os.sched_getaffinity(0))))"]
  with warnings.catch_warnings(record=True) as plain:
    warnings.simplefilter("always")
    subprocess.Popen(argv, preexec_fn=launch.child_setup([0])).wait(timeout=60)
  forks = lambda ws: [w for w in ws if "os.fork() was called" in str(w.message)]
  assert forks(plain)                        # what a plain preexec_fn costs in a JAX process
  with warnings.catch_warnings(record=True) as spawned:
    warnings.simplefilter("always")
    assert launch.spawn(argv, [0]).wait(timeout=60) == 0
  assert not forks(spawned)
  assert out.read_text() == "[0]"            # the child was still pinned before it ran


def test_flag_helpers():
  assert launch.parse_cores("0,1:2,3") == [[0, 1], [2, 3]]
  assert launch.parse_cores("0:1") == [[0], [1]]
  with pytest.raises(ValueError, match="--cores"):
    launch.parse_cores("0:")
  assert launch.with_device_count("", 2) == "--xla_force_host_platform_device_count=2"
  assert launch.with_device_count("--a=1 --xla_force_host_platform_device_count=8 --b", 1) == (
      "--a=1 --b --xla_force_host_platform_device_count=1")
  env = {"XLA_FLAGS": "--a=1"}
  launch.default_device_count(8, env)
  assert env["XLA_FLAGS"] == "--a=1 --xla_force_host_platform_device_count=8"
  chosen = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
  launch.default_device_count(8, chosen)
  assert chosen["XLA_FLAGS"] == "--xla_force_host_platform_device_count=2"


def test_command_line_reports_failure(tmp_path):
  cmd = [PY, "-m", "semijax.runtime.launch", "--num_processes=2", f"--log_dir={tmp_path}",
         "--grace_s=1", "--"] + by_process("time.sleep(30)", "sys.exit(3)")
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=30,
                        env=dict(os.environ, PYTHONPATH=ROOT))
  assert done.returncode == 1
  assert "process 1 exited with code 3" in done.stderr
  assert not any(alive(p) for p in logged_pids(tmp_path))


STOPPABLE = ("import signal\n"
             "def stop(*_):\n"
             "  print('saved at', i, flush=True); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop)\n"
             "print('ready', flush=True)\n"
             "time.sleep(60)\n")


def launched(tmp_path, *code: str, flags=()) -> subprocess.Popen:
  """The launcher's command line running `code` (as `by_process`), once every process's log
  says "ready"."""
  cmd = [PY, "-m", "semijax.runtime.launch", "--num_processes=2", f"--log_dir={tmp_path}",
         *flags, "--"] + by_process(*(f"exec({c!r})" for c in code))
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
  deadline = time.monotonic() + 30
  logs = [tmp_path / f"process{i}.log" for i in range(2)]
  while not all(p.exists() and "ready" in p.read_text() for p in logs):
    assert time.monotonic() < deadline and proc.poll() is None, "the processes did not start"
    time.sleep(0.05)
  return proc


def test_command_line_passes_sigterm_on_and_echoes_process_0(tmp_path):
  proc = launched(tmp_path, STOPPABLE,
                  STOPPABLE.replace("'ready'", "'ready', 'one'"))
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 0, err
  lines = out.splitlines()
  assert lines[:3] == [f"[0] pid {logged_pids(tmp_path)[0]}", "[0] ready", "[0] saved at 0"]
  assert "ready one" not in out          # process 1 only in its log
  assert "saved at 1" in (tmp_path / "process1.log").read_text()
  assert "stopped on SIGTERM; 2 processes saved and exited 0" in lines[-1]
  assert not any(alive(p) for p in logged_pids(tmp_path))


def test_a_process_that_does_not_stop_in_stop_s_writes_its_stacks_and_is_killed(tmp_path):
  # Process 1 ignores the SIGTERM and handles SIGUSR1 as train.py does: asked for its stacks, it
  # shows where it hung. Process 0 ignores it too but has no SIGUSR1 handler (which would end it
  # with -10 and no stacks): it is left alone until the SIGKILL.
  ignoring = STOPPABLE.replace("sys.exit(0)", "pass")
  dumping = ("import faulthandler, signal\n"
             "faulthandler.register(signal.SIGUSR1, all_threads=True)\n" + ignoring)
  proc = launched(tmp_path, ignoring, dumping, flags=["--stop_s=1"])
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=30)
  assert proc.returncode == 1
  assert "process 0 exited with code -9" in err and "all codes [-9, -9]" in err
  assert "most recent call first" in (tmp_path / "process1.log").read_text()
  assert "most recent call first" not in (tmp_path / "process0.log").read_text()
  assert not any(alive(p) for p in logged_pids(tmp_path))


# --- contention ---------------------------------------------------------------------------------


def state(pid: int) -> str:
  """The scheduler's state of `pid` (/proc/<pid>/stat): R running or waiting for a core, S
  sleeping, D waiting on I/O, T stopped by a signal."""
  with open(f"/proc/{pid}/stat") as f:
    return f.read().rsplit(")", 1)[1].split()[0]


def test_steady_competitor_burns_its_core():
  """The competitor is pinned to its core and always wants it: past start-up it takes CPU time
  and every reading finds it running or waiting for the core, never sleeping. How large a share
  it gets depends on the machine's other load, so none is asserted."""
  inj = contention.Injector(CORE)
  before = time.monotonic()
  with inj:
    pid, start = inj.pid, time.monotonic()
    assert os.sched_getaffinity(pid) == {CORE}
    while cpu_s(pid) < 0.05:        # the interpreter's start-up takes about 0.02 s of CPU
      assert time.monotonic() - start < 30, "the competitor takes no CPU"
      time.sleep(0.01)
    readings = []
    for _ in range(20):
      readings.append(state(pid))
      time.sleep(0.01)
    inside = time.monotonic() - start
  after = time.monotonic()
  assert readings == ["R"] * 20, readings
  assert not alive(pid)
  ((on, off),) = inj.intervals()      # on from start until stop
  assert on == 0.0 and inside <= off <= after - before
  inj.stop()   # idempotent
  assert not alive(pid)


def test_bursts_follow_the_schedule():
  """On 0.5 s, off 0.5 s: every reading of the competitor at least 0.1 s from a toggle it made
  finds it stopped (T) in an off phase and not stopped in an on phase; the toggles follow the
  schedule, on time or at most 0.25 s late (the thread that sends them may wait for a core)."""
  inj = contention.Injector(CORE, "bursts", on_s=0.5, off_s=0.5)
  readings = []
  before = time.monotonic()
  with inj:
    pid, start = inj.pid, time.monotonic()
    while (t := time.monotonic() - start) < 2.2:
      readings.append((t, state(pid)))
      time.sleep(0.01)
    inside = time.monotonic() - start
  after = time.monotonic()
  assert not alive(pid)
  got = inj.intervals()
  assert len(got) == 3 and got[0][0] == 0.0
  planned = [0.5, 1.0, 1.5, 2.0]                         # off, on, off, on
  toggles = [got[0][1], got[1][0], got[1][1], got[2][0]]
  assert all(p - 0.01 <= t <= p + 0.25 for p, t in zip(planned, toggles)), got
  assert inside <= got[2][1] <= after - before               # on until stop
  # A reading at t on this test's clock is at t to t + lag on the injector's.
  lag, margin = start - before, 0.1
  phases = [0.0] + toggles + [got[2][1]]
  judged = [0] * 5
  for t, s in readings:
    inside_phase = [k for k in range(5) if phases[k] + margin <= t <= phases[k + 1] - margin - lag]
    for k in inside_phase:
      judged[k] += 1
      assert (s == "T") == (k % 2 == 1), (t, s, got)
  assert min(judged[:4]) >= 1, judged
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
  with pytest.raises(ValueError, match=f"^{name}" + ("" if name.endswith("$") else ":")):
    contention.Injector(**{"core": CORE, **kwargs}).start()


def test_echo_loses_no_line_when_the_sigterm_handler_cuts_a_call_short(tmp_path):
  log = tmp_path / "process0.log"
  log.write_bytes(b"pid 1\nready\nsaved")
  seen, cut = [], []

  def out(line):
    if line == "ready" and not cut:      # the handler raises while this line is passed on
      cut.append(line)
      raise launch.StopRequested()
    seen.append(line)

  echo = launch._Echo(str(log), out)
  with pytest.raises(launch.StopRequested):
    echo()
  echo()
  assert seen == ["pid 1", "ready"]      # "saved" is not a complete line yet
  echo(final=True)
  assert seen == ["pid 1", "ready", "saved"]
