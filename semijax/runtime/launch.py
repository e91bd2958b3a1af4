r"""Start N processes on this machine joined by `jax.distributed`, and stop them cleanly.

  python -m semijax.runtime.launch --num_processes=2 --cores=0:1 -- \
      python experiments/train.py --config configs/gpt_tiny.py:cpu,tensor=2 --workdir /tmp/run

  python -m semijax.runtime.launch --num_processes=2 --platform=gpu --devices_per_process=4 \
      -- python experiments/train.py --config configs/gpt_tiny.py --workdir /tmp/run

Process i gets SEMIJAX_COORDINATOR=127.0.0.1:<free port>, SEMIJAX_NUM_PROCESSES and
SEMIJAX_PROCESS_ID (read by `semijax.distributed.initialize`), and its devices (`child_env`):
with `platform` "cpu", JAX_PLATFORMS=cpu and `--xla_force_host_platform_device_count=
<devices_per_process>` in XLA_FLAGS; with "gpu", JAX_PLATFORMS=cuda and its own
`devices_per_process` GPUs in CUDA_VISIBLE_DEVICES (of those the launcher sees: its own
CUDA_VISIBLE_DEVICES, else every GPU the driver lists), so no two processes share a GPU. The
coordinator binds to loopback only (JAX_COORDINATOR_BIND_ADDRESS).

Each child runs in its own session (so its whole process group can be signalled), pinned to
`cores[i]`, and is killed by the kernel if the launching thread dies (PR_SET_PDEATHSIG). When one
child exits non-zero the others get SIGTERM, then SIGKILL after `grace_s`; the result names the
first failure and the tail of its log. Every wait is bounded: past `timeout_s` all are killed
and a TimeoutError names the processes still running. Ctrl-C kills all.

SIGTERM to the launcher (a scheduler's preemption notice) is passed on to every process, which
saves a checkpoint at its next step boundary and exits 0 (`semijax.train.preemption`); the
launcher waits up to `stop_s` for them and exits 0 when all did; one still running then writes
its Python stacks to its log if it handles SIGUSR1 (train.py does), and is killed (SIGKILL).

On the command line, process 0's output is echoed to the launcher's console as it comes, each
line prefixed "[0] "; every process's output is in its log file.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Sequence

_PR_SET_PDEATHSIG = 1   # from <linux/prctl.h>
_POLL_S = 0.05          # how often the launcher looks at its children
_REAP_S = 5.0           # the longest wait for a process after SIGKILL
_TAIL_BYTES = 4000
_DEVICE_FLAG = "--xla_force_host_platform_device_count"


@dataclasses.dataclass
class LaunchResult:
  """What became of a launch.

  Attributes:
    returncodes: one per process; negative means killed by that signal (e.g. -15 = SIGTERM).
    log_paths: one log per process (stdout and stderr together).
    pids: the processes' ids (all reaped by the time launch returns).
    wall_s: seconds from the first start to the last exit.
    failed: id of the first process seen to exit non-zero, or None if all exited 0.
    failure_tail: the end of that process's log ("" if none failed).
    stopped: whether a SIGTERM to the launcher stopped the processes (`StopRequested`).
  """
  returncodes: list[int]
  log_paths: list[str]
  pids: list[int]
  wall_s: float
  failed: int | None = None
  failure_tail: str = ""
  stopped: bool = False

  @property
  def ok(self) -> bool:
    return self.failed is None

  def failure_message(self) -> str:
    """One paragraph for a failed launch ("" if none failed)."""
    if self.ok:
      return ""
    return (f"process {self.failed} exited with code {self.returncodes[self.failed]} "
            f"(all codes {self.returncodes}); end of {self.log_paths[self.failed]}:\n"
            f"{self.failure_tail}")


class StopRequested(Exception):
  """Raised in the launcher by its SIGTERM handler (`main`): its processes are asked to save
  and stop (SIGTERM), and given `stop_s` to do so."""


def _raise_stop(signum, frame):
  del signum, frame
  raise StopRequested()


class _Echo:
  """Passes the complete lines a log file has gained since the last call to `out`. The offset
  moves past a line only once it is passed on: a call cut short (the launcher's SIGTERM handler
  raises in its thread) loses no line; the next call passes it."""

  def __init__(self, path: str, out: Callable[[str], None]):
    self.path, self.out, self.offset = path, out, 0

  def __call__(self, final: bool = False) -> None:
    try:
      with open(self.path, "rb") as f:
        f.seek(self.offset)
        data = f.read()
    except OSError:
      return
    *lines, rest = data.split(b"\n")
    if final and rest:
      lines.append(rest)
    for line in lines:
      self.out(line.decode(errors="replace"))
      self.offset += len(line) + 1


def child_setup(cores: Sequence[int] | None) -> Callable[[], None]:
  """A `preexec_fn`: pin the child to `cores` (if given) and tie its life to this thread's.

  PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so start children from
  a thread that outlives them (normally the main thread).
  """
  parent = os.getpid()
  libc = ctypes.CDLL(None, use_errno=True)

  def setup():
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
      os._exit(120)
    if os.getppid() != parent:   # the parent died before prctl took effect
      os._exit(121)
    if cores is not None:
      os.sched_setaffinity(0, cores)

  return setup


def spawn(argv: Sequence[str], cores: Sequence[int] | None, **popen_kwargs) -> subprocess.Popen:
  """`subprocess.Popen(argv)` with `child_setup(cores)` run in the child before it execs.

  A `preexec_fn` makes Python fork through its own hooks, and JAX's hook warns that forking a
  multithreaded process may deadlock. Not here: between the fork and the exec the child calls
  only prctl, getppid and sched_setaffinity, which take no lock another thread could hold, so
  that one warning is silenced for this call alone.
  """
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=r"os\.fork\(\) was called",
                            category=RuntimeWarning)
    return subprocess.Popen(list(argv), preexec_fn=child_setup(cores), **popen_kwargs)


def free_port() -> int:
  """A TCP port free on 127.0.0.1 now (another process may take it before it is used)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def machine_cores() -> set[int]:
  """The cores of this machine that processes may be pinned to (not just this process's own:
  a benchmark process pinned to core 0 may start a competitor on core 1)."""
  return set(range(os.cpu_count() or 1)) | os.sched_getaffinity(0)


def check_cores(cores: Sequence[int], name: str) -> None:
  """Raises ValueError naming `name` unless `cores` is a non-empty list of usable core ids."""
  available = machine_cores()
  if not cores:
    raise ValueError(f"{name}: empty list of cores")
  bad = [c for c in cores if not isinstance(c, int) or c not in available]
  if bad:
    raise ValueError(f"{name}: cores {bad} are not among this machine's cores "
                     f"{sorted(available)}")


def with_device_count(xla_flags: str, count: int) -> str:
  """`xla_flags` with the host device-count flag set to `count`, other flags kept."""
  kept = [f for f in xla_flags.split() if not re.match(re.escape(_DEVICE_FLAG) + r"(=|$)", f)]
  return " ".join(kept + [f"{_DEVICE_FLAG}={count}"])


def default_device_count(count: int, environ=None) -> None:
  """Gives this process `count` fake CPU devices unless its XLA_FLAGS already chose a count
  (`environ`: default `os.environ`; call it before JAX starts its backend)."""
  environ = os.environ if environ is None else environ
  xla_flags = environ.get("XLA_FLAGS", "")
  if _DEVICE_FLAG not in xla_flags:
    environ["XLA_FLAGS"] = with_device_count(xla_flags, count)


PLATFORMS = ("cpu", "gpu")
_NVIDIA_GPUS = "/proc/driver/nvidia/gpus"


def visible_gpus(environ=None) -> list[str]:
  """The GPUs this process may hand out: CUDA_VISIBLE_DEVICES's entries where it is set, else
  one index per GPU the NVIDIA driver lists (none without the driver)."""
  environ = os.environ if environ is None else environ
  if "CUDA_VISIBLE_DEVICES" in environ:
    return [g.strip() for g in environ["CUDA_VISIBLE_DEVICES"].split(",") if g.strip()]
  try:
    return [str(i) for i in range(len(os.listdir(_NVIDIA_GPUS)))]
  except OSError:
    return []


def child_env(base: dict, i: int, platform: str, devices_per_process: int,
              gpus: Sequence[str] = ()) -> dict:
  """Process i's devices on top of `base` (see module doc): fake CPU devices, or GPUs
  i * devices_per_process ... of `gpus`."""
  env = dict(base, SEMIJAX_PROCESS_ID=str(i), PYTHONUNBUFFERED="1")   # logs show lines as said
  if platform == "cpu":
    env.update(JAX_PLATFORMS="cpu",
               XLA_FLAGS=with_device_count(base.get("XLA_FLAGS", ""), devices_per_process))
  else:
    mine = gpus[i * devices_per_process:(i + 1) * devices_per_process]
    env.update(JAX_PLATFORMS="cuda", CUDA_VISIBLE_DEVICES=",".join(mine))
  return env


def _validate(argv, num_processes, cores, devices_per_process, env, timeout_s, grace_s,
              platform) -> list[str]:
  """Raises ValueError naming a bad argument; returns the GPUs to hand out (platform gpu)."""
  if (not isinstance(argv, (list, tuple)) or not argv or
      not all(isinstance(a, str) for a in argv)):
    raise ValueError(f"argv: need a non-empty list of strings, got {argv!r}")
  if not isinstance(num_processes, int) or num_processes < 1:
    raise ValueError(f"num_processes: need an int >= 1, got {num_processes!r}")
  if cores is not None:
    if len(cores) != num_processes:
      raise ValueError(f"cores: {len(cores)} lists for num_processes={num_processes}")
    for i, c in enumerate(cores):
      check_cores(c, f"cores[{i}]")
  if not isinstance(devices_per_process, int) or devices_per_process < 1:
    raise ValueError(f"devices_per_process: need an int >= 1, got {devices_per_process!r}")
  if env is not None and not all(isinstance(k, str) and isinstance(v, str)
                                 for k, v in env.items()):
    raise ValueError("env: keys and values must be strings")
  if not timeout_s > 0:
    raise ValueError(f"timeout_s: need > 0, got {timeout_s!r}")
  if not grace_s >= 0:
    raise ValueError(f"grace_s: need >= 0, got {grace_s!r}")
  if platform not in PLATFORMS:
    raise ValueError(f"platform: {platform!r} is not one of {PLATFORMS}")
  gpus = visible_gpus(dict(os.environ, **(env or {}))) if platform == "gpu" else []
  if platform == "gpu" and num_processes * devices_per_process > len(gpus):
    raise ValueError(f"devices_per_process: {num_processes} processes x {devices_per_process} "
                     f"GPUs need {num_processes * devices_per_process}, but {len(gpus)} are "
                     f"visible ({', '.join(gpus) or 'none'})")
  return gpus


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
  """Sends `sig` to the child's process group (the child leads it; see start_new_session)."""
  try:
    os.killpg(proc.pid, sig)
  except (ProcessLookupError, PermissionError):
    pass   # the whole group is gone already


def _live_members(pgids: set[int]) -> list[int]:
  """Pids of the processes, zombies excepted, in the process groups `pgids` (from /proc)."""
  live = []
  for name in os.listdir("/proc"):
    if name.isdigit():
      try:
        with open(f"/proc/{name}/stat") as f:
          fields = f.read().rsplit(")", 1)[1].split()   # after "(command)": state, ppid, pgrp
      except OSError:
        continue   # exited meanwhile
      if fields[0] != "Z" and int(fields[2]) in pgids:
        live.append(int(name))
  return live


def _catches(pid: int, sig: int) -> bool:
  """Whether process `pid` has a handler for `sig` (its SigCgt mask in /proc/<pid>/status)."""
  try:
    with open(f"/proc/{pid}/status") as f:
      mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
  except (OSError, StopIteration):
    return False
  return bool(mask >> (sig - 1) & 1)


def _dump_stacks(procs: list[subprocess.Popen], wait_s: float = 2.0) -> None:
  """Asks every running child that handles SIGUSR1 (train.py registers `faulthandler` for it)
  for its Python threads' stacks in its log, so a job that timed out or did not stop shows
  where it was. A child without a handler is not signalled: SIGUSR1 would end it."""
  asked = False
  for p in procs:
    if p.poll() is None and _catches(p.pid, signal.SIGUSR1):
      try:
        os.kill(p.pid, signal.SIGUSR1)
        asked = True
      except ProcessLookupError:
        pass
  if asked:
    time.sleep(wait_s)


def _stop_all(procs: list[subprocess.Popen], grace_s: float, dump: bool = False) -> None:
  """SIGTERM every group, SIGKILL after grace_s; returns once no member of a group runs.
  With `dump`, a child still running at grace_s first writes its stacks (`_dump_stacks`).

  The children are reaped; their own children (orphans now) may remain as zombies until init
  reaps them, but none runs.
  """
  pgids = {p.pid for p in procs}
  try:
    for p in procs:
      _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (None in [p.poll() for p in procs] or
                                           _live_members(pgids)):
      time.sleep(_POLL_S)
    if dump:
      _dump_stacks(procs)
  finally:   # also on a second Ctrl-C during the grace period
    for p in procs:
      _signal_group(p, signal.SIGKILL)   # stragglers in the group too, even if the leader exited
    deadline = time.monotonic() + _REAP_S
    while time.monotonic() < deadline and (None in [p.poll() for p in procs] or
                                           _live_members(pgids)):
      time.sleep(_POLL_S)
    if left := [p.pid for p in procs if p.poll() is None] + _live_members(pgids):
      # Unkillable (e.g. in uninterruptible sleep): say so rather than wait forever.
      print(f"semijax.launch: pids {left} still alive {_REAP_S:g} s after SIGKILL",
            file=sys.stderr)


def _tail(path: str, nbytes: int = _TAIL_BYTES) -> str:
  with open(path, "rb") as f:
    f.seek(max(0, os.path.getsize(path) - nbytes))
    return f.read().decode(errors="replace")


def launch(argv: list[str], num_processes: int, *, cores: list[list[int]] | None = None,
           devices_per_process: int = 1, env: dict | None = None, timeout_s: float = 600,
           log_dir: str | None = None, grace_s: float = 10, stop_s: float = 120,
           echo: Callable[[str], None] | None = None, platform: str = "cpu") -> LaunchResult:
  """Runs `argv` as `num_processes` processes of one jax.distributed job on this machine.

  Args:
    argv: the command every process runs (e.g. [sys.executable, "experiments/train.py", ...]).
    num_processes: how many processes.
    cores: cores[i] = the core ids process i is pinned to; None = no pinning.
    devices_per_process: fake CPU devices, or GPUs, per process.
    env: variables added to this process's environment for the children.
    timeout_s: the longest the whole job may run.
    log_dir: where process{i}.log go; None = a new temporary directory.
    grace_s: after SIGTERM (one process failed, or a timeout), how long to wait before SIGKILL.
    stop_s: after `StopRequested` reached the launcher, how long the processes have to save
      and exit before SIGKILL.
    echo: called with each line of process 0's output as it comes (None: only the log).
    platform: "cpu" (fake devices) or "gpu" (each process its own GPUs; see module doc).

  Returns:
    A LaunchResult; `result.ok` is False if a process exited non-zero (the others were stopped).

  Raises:
    ValueError: a bad argument (before anything starts).
    TimeoutError: timeout_s passed; all processes were killed.
  """
  gpus = _validate(argv, num_processes, cores, devices_per_process, env, timeout_s, grace_s,
                   platform)
  if not stop_s >= 0:
    raise ValueError(f"stop_s: need >= 0, got {stop_s!r}")
  log_dir = log_dir or tempfile.mkdtemp(prefix="semijax-launch-")
  os.makedirs(log_dir, exist_ok=True)
  log_paths = [os.path.join(log_dir, f"process{i}.log") for i in range(num_processes)]
  port = free_port()
  base = dict(os.environ, **(env or {}))
  base.update(SEMIJAX_COORDINATOR=f"127.0.0.1:{port}",
              JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",   # not every interface
              SEMIJAX_NUM_PROCESSES=str(num_processes))

  procs: list[subprocess.Popen] = []
  start = time.monotonic()
  follow = _Echo(log_paths[0], echo) if echo is not None else (lambda final=False: None)
  stopped, failed = False, None
  try:
    for i in range(num_processes):
      with open(log_paths[i], "wb") as log:   # the child keeps its own copy of the descriptor
        procs.append(spawn(
            argv, cores[i] if cores else None,
            env=child_env(base, i, platform, devices_per_process, gpus),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True))
    while failed is None and None in [p.poll() for p in procs]:   # poll every one
      if time.monotonic() - start > timeout_s:
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        _dump_stacks(procs)
        _stop_all(procs, grace_s)
        raise TimeoutError(f"processes {running} still running after timeout_s="
                           f"{timeout_s:g}; killed all (logs in {log_dir})")
      failed = next((i for i, p in enumerate(procs) if p.returncode not in (None, 0)), None)
      follow()
      if failed is None:
        time.sleep(_POLL_S)
  except StopRequested:
    stopped = True
    _stop_all(procs, stop_s, dump=True)    # each saves at its next step boundary and exits
  finally:
    _stop_all(procs, grace_s)   # a no-op once all exited; kills all on errors and Ctrl-C
    follow(final=True)
  if failed is None:   # every process exited; one may have failed in the last poll
    failed = next((i for i, p in enumerate(procs) if p.returncode != 0), None)
  return LaunchResult(returncodes=[p.returncode for p in procs], log_paths=log_paths,
                      pids=[p.pid for p in procs], wall_s=time.monotonic() - start, failed=failed,
                      failure_tail="" if failed is None else _tail(log_paths[failed]),
                      stopped=stopped)


def parse_cores(text: str) -> list[list[int]]:
  """ "0,1:2,3" -> [[0, 1], [2, 3]] (processes separated by ':', cores by ',')."""
  try:
    return [[int(c) for c in part.split(",")] for part in text.split(":")]
  except ValueError:
    raise ValueError(f"--cores: expected e.g. '0:1' or '0,1:2,3', got {text!r}") from None


def parser() -> argparse.ArgumentParser:
  """The launcher's command line: its own flags, then `--` and the command every process runs."""
  p = argparse.ArgumentParser(
      prog="python -m semijax.runtime.launch", description=__doc__.split("\n\n")[0],
      usage="%(prog)s --num_processes=N [--cores=0:1] [...] -- COMMAND ...")
  p.add_argument("--num_processes", type=int, required=True)
  p.add_argument("--cores", default=None, help="e.g. 0:1 or 0,1:2,3")
  p.add_argument("--devices_per_process", type=int, default=1)
  p.add_argument("--platform", choices=PLATFORMS, default="cpu",
                 help="cpu: fake CPU devices; gpu: each process its own GPUs")
  p.add_argument("--timeout_s", type=float, default=600)
  p.add_argument("--grace_s", type=float, default=10)
  p.add_argument("--stop_s", type=float, default=120,
                 help="on SIGTERM, how long the processes have to save and exit")
  p.add_argument("--log_dir", default=None)
  p.add_argument("command", nargs=argparse.REMAINDER)
  return p


def main(args: list[str] | None = None) -> int:
  flags = parser().parse_args(args)
  command = flags.command[1:] if flags.command[:1] == ["--"] else flags.command
  # SIGTERM to the launcher asks the children to save and stop (instead of leaving the kernel's
  # PDEATHSIG to SIGKILL only the group leaders).
  signal.signal(signal.SIGTERM, _raise_stop)
  signal.signal(signal.SIGINT, signal.default_int_handler)   # even if started with SIGINT ignored
  try:
    result = launch(command, flags.num_processes,
                    cores=parse_cores(flags.cores) if flags.cores else None,
                    devices_per_process=flags.devices_per_process, timeout_s=flags.timeout_s,
                    log_dir=flags.log_dir, grace_s=flags.grace_s, stop_s=flags.stop_s,
                    echo=lambda line: print(f"[0] {line}", flush=True),
                    platform=flags.platform)
  except (ValueError, TimeoutError) as e:
    print(f"semijax.launch: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("semijax.launch: interrupted; stopped all processes", file=sys.stderr)
    return 130
  except StopRequested:       # a second SIGTERM while the processes were saving
    print("semijax.launch: SIGTERM again while stopping; killed all processes", file=sys.stderr)
    return 143
  if not result.ok:
    print(f"semijax.launch: {result.failure_message()}", file=sys.stderr)
    return 1
  if result.stopped:
    print(f"semijax.launch: stopped on SIGTERM; {flags.num_processes} processes saved and "
          f"exited 0 in {result.wall_s:.1f} s (logs: {os.path.dirname(result.log_paths[0])})")
    return 0
  print(f"semijax.launch: {flags.num_processes} processes exited 0 in {result.wall_s:.1f} s "
        f"(logs: {os.path.dirname(result.log_paths[0])})")
  return 0


if __name__ == "__main__":
  sys.exit(main())
