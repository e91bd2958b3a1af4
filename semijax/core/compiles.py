"""Counting XLA compilations, to show that nothing compiles on the hot path.

`jax.monitoring` reports every backend compilation (including ones served from the persistent
compilation cache, which still build a new executable) as the event
"/jax/core/compile/backend_compile_duration". `count()` is the number seen so far in this
process; a run records it after warm-up and again at the end.
"""

from __future__ import annotations

import threading

import jax

EVENT = "/jax/core/compile/backend_compile_duration"

_lock = threading.Lock()
_count = 0
_registered = False


def _listener(event: str, duration_secs: float, **kwargs) -> None:
  del duration_secs, kwargs
  global _count
  if event == EVENT:
    with _lock:
      _count += 1


def count() -> int:
  """XLA compilations in this process since the first call of `count()`."""
  global _registered
  with _lock:
    if not _registered:
      jax.monitoring.register_event_duration_secs_listener(_listener)
      _registered = True
    return _count
