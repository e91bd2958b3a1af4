"""Preemption: a run asked to stop (SIGTERM, as cluster schedulers send before they reclaim a
machine) saves a checkpoint at the next step boundary and exits 0; the rerun resumes there.

One process: a SIGTERM handler notes the request; the loop sees it at the next step boundary.
Several processes (`jax.distributed`): JAX's preemption service already catches SIGTERM in every
process and spreads a notice to all; `multihost_utils.reached_preemption_sync_point(step)` (what
Orbax's `CheckpointManager.reached_preemption` calls) is True on every process at the same
step, so they save the same checkpoint together. That needs every process to ask at every step
from the same first step, which holds for runs whose processes step together (local_sgd with
one replica per process too; not ssaw / async there, whose processes count their own updates:
those save at their coordinator's cuts instead).
"""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preemption:
  """Whether the run was asked to stop, agreed by every process at a step boundary.

  Use as a context manager: the one-process SIGTERM handler is installed on entry and the
  previous one put back on exit.
  """

  def __init__(self):
    self.requested = False
    self._multi = jax.process_count() > 1
    self._previous = None
    self._service = True

  def __enter__(self) -> Preemption:
    if not self._multi and threading.current_thread() is threading.main_thread():
      self._previous = signal.signal(signal.SIGTERM, self._note)
    return self

  def __exit__(self, *exc) -> None:
    if self._previous is not None:
      signal.signal(signal.SIGTERM, self._previous)
      self._previous = None

  def _note(self, signum, frame) -> None:
    del signum, frame
    self.requested = True

  def reached(self, step: int) -> bool:
    """True at the step boundary where the run saves and stops (the same `step` on every
    process); call it at every step."""
    if not self._multi:
      return self.requested
    if not self._service:
      return False
    try:
      return multihost_utils.reached_preemption_sync_point(step)
    except RuntimeError:       # the service is off (jax_enable_preemption_service=False)
      self._service = False
      return False
