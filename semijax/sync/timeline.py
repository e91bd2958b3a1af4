"""Who computes what, and when each update happens, for replicas of different speeds.

`Timeline` is the round rule of `ssaw` and `async` (and, for comparison, `sync`) played on a
clock: pure host arithmetic, no JAX. The emulated mode runs it on the emulated clock, the step
time predictor (`predict`) on predicted compute times, and the real multi-process coordinator
follows the same rule on the wall clock (`real`).

The model of work. The epoch is a stream of microbatches of `microbatch_samples` samples each
(microbatch j is data shard j mod R of global batch j div R, so R replicas taking microbatches
in turn see exactly synchronous data parallelism's batches). A free replica claims the next
unclaimed microbatch, computes its gradient on the parameters of the current version, and
arrives some seconds later. Every sample is claimed exactly once; a fast replica claims more.

The round rule. An update (a *round*) closes when:
  * sync: every replica in flight has arrived;
  * ssaw/async: the first *fresh* replica (one computing on the current version) has arrived,
    plus every replica arriving within `grace` times that replica's compute time after it
    (async: grace 0, only ties); and every replica whose gradient would otherwise be applied
    more than `staleness_bound` updates after the version it was computed on (the others
    wait for it: the bound). Once the stream is exhausted, the next round waits for every
    replica in flight (the last update applies every claimed sample).
A replica that arrived is a member of the next round that closes after its arrival; its gradient
is applied there with staleness = the current version - the version it computed on. Members
then claim their next microbatches and start on the new version.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from semijax.sync import settings as settings_lib


@dataclasses.dataclass(frozen=True)
class Work:
  """One replica's microbatch in flight.

  Attributes:
    microbatch: its index in the stream. base: the version it computes on.
    start_s, arrive_s: when it started and when its gradient is ready (clock seconds).
    samples: its samples.
  """

  microbatch: int
  base: int
  start_s: float
  arrive_s: float
  samples: int


@dataclasses.dataclass(frozen=True)
class Round:
  """One update.

  Attributes:
    version: the version this update makes (1 = the first update).
    open_s: when the previous update closed; close_s: when this one closes.
    members: the replicas whose gradients it applies (ascending).
    microbatches, staleness, samples: per member.
  """

  version: int
  open_s: float
  close_s: float
  members: tuple[int, ...]
  microbatches: tuple[int, ...]
  staleness: tuple[int, ...]
  samples: tuple[int, ...]

  def is_step(self, num_replicas: int, microbatch_samples: int) -> bool:
    """Whether this round is exactly a synchronous step: every replica, fresh, with microbatch
    r of one global batch on replica r."""
    if self.members != tuple(range(num_replicas)) or any(self.staleness):
      return False
    first = self.microbatches[0]
    return (first % num_replicas == 0 and
            self.microbatches == tuple(range(first, first + num_replicas)) and
            all(n == microbatch_samples for n in self.samples))


class Timeline:
  """The round rule on a clock (see module doc).

  Args:
    settings: mode (sync, ssaw, async), grace and staleness bound.
    num_replicas: R.
    microbatch_samples: samples per microbatch (batch_size / R).
    total_microbatches: the stream's length (steps x R).
  """

  def __init__(self, settings: settings_lib.SyncSettings, num_replicas: int,
               microbatch_samples: int, total_microbatches: int):
    self.settings = settings
    self.num_replicas = num_replicas
    self.microbatch_samples = microbatch_samples
    self.total_microbatches = total_microbatches
    self.now_s = 0.0          # when the latest update closed
    self.version = 0          # updates so far
    self.next_microbatch = 0  # the first unclaimed microbatch
    self.work: list[Work | None] = [None] * num_replicas

  @property
  def exhausted(self) -> bool:
    return self.next_microbatch >= self.total_microbatches

  @property
  def done(self) -> bool:
    return self.exhausted and all(w is None for w in self.work)

  def start(self, durations: Sequence[float], delay_s: float = 0.0) -> list[tuple[int, int]]:
    """Every free replica claims the next microbatch (in replica order) and starts it
    `delay_s` after the latest close; `durations[r]` = seconds replica r needs for it.
    Returns [(replica, microbatch)] of the claims."""
    claims = []
    for r in range(self.num_replicas):
      if self.work[r] is None and not self.exhausted:
        start = self.now_s + delay_s
        self.work[r] = Work(self.next_microbatch, self.version, start, start + float(durations[r]),
                            self.microbatch_samples)
        claims.append((r, self.next_microbatch))
        self.next_microbatch += 1
    return claims

  def peek(self) -> Round | None:
    """The next round (None when nothing is in flight), without taking it."""
    flying = [r for r, w in enumerate(self.work) if w is not None]
    if not flying:
      return None
    arrive = {r: self.work[r].arrive_s for r in flying}
    mode, bound = self.settings.mode, self.settings.staleness_bound
    fresh = [r for r in flying if self.work[r].base == self.version]
    if mode == "sync" or self.exhausted or not fresh:
      close = max(arrive.values())
    else:
      first = min(arrive[r] for r in fresh)
      grace = self.settings.grace if mode == "ssaw" else 0.0
      deadline = first + grace * (first - self.now_s)
      close = max(t for t in arrive.values() if t <= deadline)
      while True:   # the bound: nobody may fall more than `bound` versions behind
        forced = [arrive[r] for r in flying
                  if arrive[r] > close and self.version + 1 - self.work[r].base > bound]
        if not forced:
          break
        close = max(forced)
    members = tuple(r for r in flying if arrive[r] <= close)
    return Round(self.version + 1, self.now_s, close, members,
                 tuple(self.work[r].microbatch for r in members),
                 tuple(self.version - self.work[r].base for r in members),
                 tuple(self.work[r].samples for r in members))

  def take(self) -> Round | None:
    """The next round, taken: the clock moves to its close, its members become free."""
    rnd = self.peek()
    if rnd is None:
      return None
    self.now_s, self.version = rnd.close_s, rnd.version
    for r in rnd.members:
      self.work[r] = None
    return rnd

  # --- checkpoints ------------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """The clock, counters and work in flight as numpy arrays (a checkpoint's `extra`)."""
    present = np.array([w is not None for w in self.work])
    field = lambda name, dtype: np.array([getattr(w, name) if w is not None else 0
                                          for w in self.work], dtype)
    return {"now_s": np.float64(self.now_s), "version": np.int64(self.version),
            "next_microbatch": np.int64(self.next_microbatch), "present": present,
            "microbatch": field("microbatch", np.int64), "base": field("base", np.int64),
            "start_s": field("start_s", np.float64), "arrive_s": field("arrive_s", np.float64),
            "samples": field("samples", np.int64)}

  def load_state_dict(self, state: dict) -> None:
    self.now_s = float(state["now_s"])
    self.version = int(state["version"])
    self.next_microbatch = int(state["next_microbatch"])
    self.work = [Work(int(state["microbatch"][r]), int(state["base"][r]),
                      float(state["start_s"][r]), float(state["arrive_s"][r]),
                      int(state["samples"][r])) if state["present"][r] else None
                 for r in range(self.num_replicas)]
