"""How the data-parallel replicas of a simulated step are combined: a small registry.

A strategy turns the replicas' times (float [R]: compute through the optimizer update, for one
global batch's share each) and the seconds of one gradient all-reduce among them into the
seconds of one global batch of samples:

  sync       synchronous data parallelism (`jax.lax.psum` over `data`): every replica waits for
             the slowest, then the gradients are all-reduced.
  ssaw       SSAW (`semijax.sync`, docs/ssaw.md): semi-synchronous rounds with adaptive weights.
  async      bounded-staleness asynchronous data parallelism (`semijax.sync`'s baseline).
  local_sgd  local steps, parameter deltas averaged every `local_steps` (`semijax.sync`).

The three `semijax.sync` modes are the library's own predictor, `sync.predict.predict`, which
plays the library's round rule (`sync.timeline.Timeline`, what an ssaw run follows) on the
replicas' times: a change to the round rule changes the simulation. Its seconds per global batch
are the step's (every mode trains the same samples per step; what staleness costs in accuracy is
not simulated: `Mode.staleness` keeps the predicted mean staleness). The prediction scales with
time, so it is cached by the replicas' times relative to the fastest.

A new strategy is a class with `name` and `combine` and an entry in `REGISTRY`. `PENDING` names
the parts of the design without library code yet.
"""

from __future__ import annotations

import numpy as np

from semijax.errors import ConfigError
from semijax.sync import predict as predict_lib
from semijax.sync import settings as sync_settings_lib

# Relative precision of the cache key of a `semijax.sync` prediction.
KEY_DIGITS = 4


class Sync:
  """Synchronous data parallelism: max over replicas, then the all-reduce."""

  name = "sync"

  def combine(self, replicas: np.ndarray, allreduce_s: float) -> tuple[float, float]:
    """(step seconds, seconds after the slowest replica)."""
    return float(np.max(replicas)) + allreduce_s, allreduce_s


class Mode:
  """A data-parallel mode of `semijax.sync`, predicted by `sync.predict.predict` (module doc)."""

  name = ""

  def __init__(self, settings: sync_settings_lib.SyncSettings | None = None):
    self.settings = settings or sync_settings_lib.SyncSettings(mode=self.name)
    self._cache: dict = {}
    self.staleness: list[float] = []

  def combine(self, replicas: np.ndarray, allreduce_s: float) -> tuple[float, float]:
    t = np.asarray(replicas, np.float64)
    scale = float(t.min())
    key = (tuple(np.round(t / scale, KEY_DIGITS)), round(allreduce_s / scale, KEY_DIGITS))
    if key not in self._cache:
      p = predict_lib.predict(self.name, np.asarray(key[0]), comm_s=key[1],
                              settings=self.settings)
      self._cache[key] = (p.batch_s, p.mean_staleness)
    batch, staleness = self._cache[key]
    self.staleness.append(staleness)
    seconds = batch * scale
    return seconds, seconds - float(t.max())


class Ssaw(Mode):
  name = "ssaw"


class Async(Mode):
  name = "async"


class LocalSgd(Mode):
  name = "local_sgd"


REGISTRY = {s.name: s for s in (Sync, Ssaw, Async, LocalSgd)}

# Parts of HarmonyTrain (docs/design.md) without library code yet: none. (The partition and
# placement planner, `semijax.planner`, is the study's `planner` column: its uneven stages go to
# `StepModel(layers=...)`, `sim.planning.stage_layers`.)
PENDING = ()


def make(name: str):
  if name not in REGISTRY:
    pending = f" ({name} is not in the library yet)" if name in PENDING else ""
    raise ConfigError(f"sim.strategy: {name!r} is not one of {list(REGISTRY)}{pending}")
  return REGISTRY[name]()
