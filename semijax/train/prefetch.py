"""Batches prepared one step ahead on a thread (`Prefetch`): reading a step's host rows and
placing them on the devices overlaps the step before it, instead of delaying its dispatch.
`OnTheSpot` makes each when asked (`config.run_ahead` False)."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Callable, Protocol


class Batches(Protocol):
  """Where a loop gets each step's batch."""

  def get(self, step: int):
    """The batch of 0-based `step`."""

  def close(self) -> None:
    """Releases what making batches holds (a thread)."""


class Prefetch:
  """`get(step)` returns `make(step)` and starts `make(step + 1)` on a worker thread; steps
  asked for in order come ready-made, any other is made on the spot (a resume, a replay).

  Args:
    make: 0-based step -> that step's batch (e.g. the dataset's rows, sharded for the engine:
      arrays placed over `data`, global shape [batch, ...]).
  """

  def __init__(self, make: Callable[[int], Any]):
    self._make = make
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="semijax-batches")
    self._next: tuple[int, concurrent.futures.Future] | None = None

  def get(self, step: int):
    """The batch of 0-based `step` (an error making it is raised here)."""
    ahead, self._next = self._next, None
    if ahead is not None and ahead[0] == step:
      batch = ahead[1].result()
    else:
      if ahead is not None:
        ahead[1].cancel()
      batch = self._make(step)
    self._next = (step + 1, self._pool.submit(self._make, step + 1))
    return batch

  def close(self) -> None:
    """Ends the worker thread (a batch it is making is finished and dropped)."""
    self._next = None
    self._pool.shutdown(wait=True, cancel_futures=True)


class OnTheSpot:
  """`Prefetch`'s interface, each batch made when asked for, in the caller's thread."""

  def __init__(self, make: Callable[[int], Any]):
    self._make = make

  def get(self, step: int):
    return self._make(step)

  def close(self) -> None:
    pass
