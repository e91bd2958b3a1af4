"""Moving a padded train state between layouts, and timing what a move costs.

Inside a capacity bucket a move is the migration collective (`core.migrate`): only units that
change owner travel. Between buckets (the tight bucket of the even split and the big one) the
state is re-laid out through its logical form (`Engine.relayout`).
"""

from __future__ import annotations

import time

import jax

from semijax.balance import buckets as buckets_lib
from semijax.balance import speed as speed_lib
from semijax.core import layout as layout_lib
from semijax.core import migrate as migrate_lib


class Mover:
  """Moves padded states of one engine between layouts (see module doc).

  Args:
    engine: the run's `core.engine.Engine` (its migrator and packers).
  """

  def __init__(self, engine):
    self.engine = engine
    self.migrator = engine.migrator()
    self.moves = 0
    self.seconds = 0.0

  def move(self, state, old: layout_lib.Layout, new: layout_lib.Layout):
    """The state moved from layout `old` to `new` (same values, new owners)."""
    if buckets_lib.capacities(new) != buckets_lib.capacities(old):
      return self.engine.relayout(state, old, new)
    return self.migrator.migrate_state(state, migrate_lib.plan(old, new), self.engine.tx,
                                       self.engine.axes)

  def timed_move(self, state, old: layout_lib.Layout, new: layout_lib.Layout):
    """(moved state, seconds of the slowest process): a move of the training loop, counted."""
    t0 = time.perf_counter()
    state = self.move(state, old, new)
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    self.moves += 1
    self.seconds += seconds
    return state, self.shared(seconds)

  @staticmethod
  def shared(seconds: float) -> float:
    """The slowest process's seconds (decision inputs must be the same on every process)."""
    return speed_lib.gather_times({}, seconds)[1]
