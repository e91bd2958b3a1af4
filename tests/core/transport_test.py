"""Finding the collectives' transport threads and lowering their priority: a hand-built /proc
tree, and a real thread of this process blocked in epoll."""

import os
import platform
import select
import sys
import threading

import pytest

from semijax import errors
from semijax.core import transport

MACHINE = platform.machine()
EPOLL = min(transport.EPOLL_SYSCALLS.get(MACHINE, {0}))
linux_epoll = pytest.mark.skipif(not sys.platform.startswith("linux")
                                 or MACHINE not in transport.EPOLL_SYSCALLS,
                                 reason="threads are read through Linux's /proc")


def test_nice_value_from_the_argument_the_environment_or_the_default(monkeypatch):
  monkeypatch.delenv(transport.ENV, raising=False)
  assert transport.nice_value() == transport.DEFAULT_NICE == 19
  assert transport.nice_value(0) == 0
  monkeypatch.setenv(transport.ENV, "7")
  assert transport.nice_value() == 7
  assert transport.nice_value(3) == 3                # the argument wins
  for bad in ("high", "20", "-1", "1.5"):
    monkeypatch.setenv(transport.ENV, bad)
    with pytest.raises(errors.InputError, match=transport.ENV):
      transport.nice_value()
  for bad in (20, -1, True, 2.0):
    with pytest.raises(errors.InputError, match="nice"):
      transport.nice_value(bad)


def test_waits_in_epoll_reads_the_syscall_number_of_its_architecture():
  line = "{} 0xa 0x7ffd 0x40 0xa 0x0 0x0 0x7ffd 0x7f12"
  assert transport.waits_in_epoll(line.format(232), "x86_64")
  assert transport.waits_in_epoll(line.format(281), "x86_64")         # epoll_pwait
  assert not transport.waits_in_epoll(line.format(202), "x86_64")     # futex
  assert transport.waits_in_epoll(line.format(22), "aarch64")
  assert not transport.waits_in_epoll(line.format(232), "aarch64")
  assert not transport.waits_in_epoll(line.format(232), "riscv64")    # unknown: never
  assert not transport.waits_in_epoll("running", "x86_64")
  assert not transport.waits_in_epoll("", "x86_64")


def _task(root, tid, comm, syscall):
  path = root / str(tid)
  path.mkdir()
  (path / "comm").write_text(comm + "\n")
  (path / "syscall").write_text(syscall + "\n")


@linux_epoll
def test_transport_threads_are_the_unnamed_ones_waiting_in_epoll(tmp_path):
  main = os.getpid()
  _task(tmp_path, main, "python", f"{EPOLL} 0x3")              # the main thread: never
  _task(tmp_path, 900001, "python", f"{EPOLL} 0x3")            # gloo's loop
  _task(tmp_path, 900002, "grpc_global_tim", f"{EPOLL} 0x3")   # named: gRPC's
  _task(tmp_path, 900003, "python", "202 0x1")                 # waits on a futex
  _task(tmp_path, 900004, "python", "running")
  _task(tmp_path, 900005, "tf_XLAEigen", f"{EPOLL} 0x3")
  assert transport.transport_threads(str(tmp_path), samples=1) == [900001]
  # a loop seen running in one reading and waiting in the next is found
  (tmp_path / "900004" / "syscall").write_text(f"{EPOLL} 0x3\n")
  assert transport.transport_threads(str(tmp_path), samples=2, interval_s=0) == [900001, 900004]
  assert transport.transport_threads(str(tmp_path / "missing")) == []


@linux_epoll
def test_yield_to_steps_lowers_a_real_epoll_threads_priority_and_nothing_else(monkeypatch):
  monkeypatch.delenv(transport.ENV, raising=False)
  ready, stop = threading.Event(), threading.Event()
  tids = {}
  base = os.getpriority(os.PRIO_PROCESS, 0)      # this thread's (CI may run the suite niced)
  with open(f"/proc/{os.getpid()}/comm") as f:
    own = f.read().strip()

  def loop():        # stands in for gloo's event loop: unnamed, blocked in epoll
    tids["loop"] = threading.get_native_id()
    with open(f"/proc/self/task/{tids['loop']}/comm", "w") as f:
      f.write(own)   # newer Pythons name their threads; gloo's are not named
    poller = select.epoll()
    ready.set()
    while not stop.is_set():
      poller.poll(0.05)
    poller.close()

  def busy():        # another unnamed thread, not in epoll
    tids["other"] = threading.get_native_id()
    with open(f"/proc/self/task/{tids['other']}/comm", "w") as f:
      f.write(own)
    stop.wait()

  threads = [threading.Thread(target=loop), threading.Thread(target=busy)]
  for t in threads:
    t.start()
  try:
    assert ready.wait(10)
    assert tids["loop"] in transport.transport_threads(samples=20)
    assert transport.yield_to_steps(0) == {}                      # 0 changes nothing
    assert os.getpriority(os.PRIO_PROCESS, tids["loop"]) == base
    changed = transport.yield_to_steps()
    assert changed.get(tids["loop"]) == 19
    assert os.getpriority(os.PRIO_PROCESS, tids["loop"]) == 19
    assert tids["other"] not in changed
    assert os.getpriority(os.PRIO_PROCESS, tids["other"]) == base
    assert os.getpriority(os.PRIO_PROCESS, 0) == base
  finally:
    stop.set()
    for t in threads:
      t.join(10)

