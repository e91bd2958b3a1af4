"""Preemption: a run asked to stop (SIGTERM, as cluster schedulers send before they reclaim a
machine) saves a checkpoint at the next step boundary and exits 0; the rerun resumes there.

One process: a SIGTERM handler notes the request; the loop sees it at the next step boundary.
Several processes (`jax.distributed`): JAX's preemption service already catches SIGTERM in every
process and spreads a notice to all; `multihost_utils.reached_preemption_sync_point(step)` (what
Orbax's `CheckpointManager.reached_preemption` calls) is True on every process at the same
step, so they save the same checkpoint together. That needs every process to ask at every step
from the same first step, which holds for runs whose processes step together (local_sgd with
one replica per process too). ssaw / async with one replica per process count their own
updates: each process notes its SIGTERM itself (`by_process`), and the run stops at a cut its
coordinator makes (`process_modes.Rounds`).
"""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preemption:
  """Whether the run was asked to stop, agreed by every process at a step boundary.

  Use as a context manager: the SIGTERM handler (one process, or `by_process`) is installed on
  entry and the previous one put back on exit.

  Args:
    by_process: each process notes its own SIGTERM in `requested` (in place of JAX's preemption
      service) and `reached` is never true: the run agrees on where to stop by other means.
  """

  def __init__(self, by_process: bool = False):
    self.requested = False
    self._multi = jax.process_count() > 1 and not by_process
    self._own = not self._multi
    self._previous, self._installed = None, False
    self._service = True
    self._calls = 0

  def __enter__(self) -> Preemption:
    if self._own and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._note)
      self._installed = True
    return self

  def __exit__(self, *exc) -> None:
    if self._installed:
      # (a handler installed outside Python, e.g. JAX's preemption service, reads as None)
      signal.signal(signal.SIGTERM, self._previous or signal.SIG_DFL)
      self._installed = False

  def _note(self, signum, frame) -> None:
    del signum, frame
    self.requested = True

  def reached(self, step: int) -> bool:
    """True at the step boundary where the run saves and stops (the same `step` on every
    process); call it at every step."""
    if not self._multi:
      return self.requested and jax.process_count() == 1
    if not self._service:
      return False
    # The service counts from the first call: a notice that comes before it (during a resumed
    # run's warm-up) agrees on call 1, so the calls are counted here, not by the step.
    del step
    self._calls += 1
    try:
      return multihost_utils.reached_preemption_sync_point(self._calls)
    except RuntimeError:       # the service is off (jax_enable_preemption_service=False)
      self._service = False
      return False
