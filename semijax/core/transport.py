"""The threads of the CPU collectives' transport, and letting the step's thread run before them.

On CPU, collectives between processes go through gloo, whose TCP transport runs event-loop
threads (an `epoll` loop each, started by XLA, unnamed, so they carry the process's name).
A process of the benchmarks owns one core, and there that thread competes with the thread that
runs the step: on this project's 2-core machine (2 processes pinned to a core each) `perf` found
it returning from `epoll_wait` over and over during the collectives, at the step thread's
priority, and one all-reduce of 1 KB took a median of 3.9-4.9 ms (0.8 ms with that thread at
nice 19; 0.1 ms with the whole process at real-time priority). The measurements, and the
training step's with and without it, are in docs/performance.md and docs/benchmarks.md.

`yield_to_steps` gives those threads a higher nice value (a lower priority) once they exist
(after the first collectives ran): the scheduler then gives the core to the step's thread
first, and they run mostly while it waits. Linux only (threads are found through /proc);
elsewhere it does nothing. The nice value comes from the argument, else from the environment
variable SEMIJAX_TRANSPORT_NICE, else `DEFAULT_NICE`; 0 leaves the threads as they are.
"""

from __future__ import annotations

import os
import platform
import threading
import time

from semijax import errors

DEFAULT_NICE = 19
ENV = "SEMIJAX_TRANSPORT_NICE"

# Linux syscall numbers of epoll_wait, epoll_pwait and epoll_pwait2 (/proc/<tid>/syscall's first
# field while a thread waits in one of them).
EPOLL_SYSCALLS = {"x86_64": {232, 281, 441}, "aarch64": {22, 441}}

_TASKS = "/proc/self/task"


def nice_value(nice: int | None = None) -> int:
  """The nice value to give the transport's threads: `nice`, else $SEMIJAX_TRANSPORT_NICE, else
  DEFAULT_NICE.

  Raises:
    errors.InputError: not an integer from 0 to 19 (naming where it came from).
  """
  source, value = "nice", nice
  if value is None:
    source, value = ENV, os.environ.get(ENV, str(DEFAULT_NICE))
    try:
      value = int(value)
    except ValueError:
      raise errors.InputError(f"{ENV}: {value!r} is not an integer from 0 to 19") from None
  if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 19:
    raise errors.InputError(f"{source}: {value!r} is not an integer from 0 to 19 (0 leaves "
                            "the collectives' transport threads as they are)")
  return value


def waits_in_epoll(syscall_text: str, machine: str | None = None) -> bool:
  """Whether a /proc/<tid>/syscall reading shows a thread blocked in epoll ("running", an
  unknown architecture, or another syscall: False)."""
  numbers = EPOLL_SYSCALLS.get(machine or platform.machine(), set())
  first = syscall_text.split(maxsplit=1)[:1]
  return bool(first) and first[0].isdigit() and int(first[0]) in numbers


def _read(path: str) -> str | None:
  try:
    with open(path) as f:
      return f.read().strip()
  except OSError:   # the thread exited, or no /proc
    return None


def transport_threads(tasks: str = _TASKS, *, samples: int = 5,
                      interval_s: float = 0.002) -> list[int]:
  """Thread ids of this process's unnamed threads seen waiting in epoll (gloo's event loops).

  Unnamed threads carry the process's own name (/proc/<tid>/comm); gRPC's (the coordination
  service client) and XLA's worker threads are named, and the calling and main threads are left
  out. A loop that is busy when read shows "running", so the threads are read `samples` times,
  `interval_s` apart. [] without /proc.
  """
  own = _read(os.path.join(tasks, str(os.getpid()), "comm"))
  if own is None:                                    # no /proc
    return []
  skip = {os.getpid(), threading.get_native_id()}
  candidates = [int(t) for t in os.listdir(tasks) if t.isdigit() and int(t) not in skip
                and _read(os.path.join(tasks, t, "comm")) == own]
  found: set[int] = set()
  for k in range(samples):
    for tid in candidates:
      text = _read(os.path.join(tasks, str(tid), "syscall"))
      if text is not None and waits_in_epoll(text):
        found.add(tid)
    if k + 1 < samples:
      time.sleep(interval_s)
  return sorted(found)


def yield_to_steps(nice: int | None = None) -> dict[int, int]:
  """Gives the transport's threads (`transport_threads`) the nice value `nice_value(nice)`.

  Call it once the first collectives ran (they start the threads); calling again is harmless.

  Returns:
    {thread id: its nice value now} for every thread changed ({} when nice is 0, off Linux or
    when none was found).

  Raises:
    errors.InputError: a bad nice value (`nice_value`).
  """
  value = nice_value(nice)
  return {} if value == 0 else set_nice(transport_threads(), value)


def set_nice(tids, value: int) -> dict[int, int]:
  """Sets the nice value of each thread in `tids` (a thread that exited meanwhile is skipped);
  returns {thread id: its nice value now}."""
  changed = {}
  for tid in tids:
    try:
      os.setpriority(os.PRIO_PROCESS, tid, value)   # on Linux, per thread
      changed[tid] = os.getpriority(os.PRIO_PROCESS, tid)
    except OSError:
      continue
  return changed
