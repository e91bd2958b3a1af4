"""Moving a padded train state between layouts, and timing what a move costs.

Every move, inside a capacity bucket or between buckets (the tight bucket of the even split and
the big one), is the migration collective (`Engine.move`, `core.migrate`): only units that change
owner travel, in chunks of a few precompiled sizes, one (block, kind) group of weights and
moments at a time, each group's old copy donated: no device ever holds the old and the new
state at once.
"""

from __future__ import annotations

import time

import jax

from semijax.balance import speed as speed_lib
from semijax.core import layout as layout_lib


class Mover:
  """Moves padded states of one engine between layouts (see module doc).

  Args:
    engine: the run's `core.engine.Engine` (its migrator and packers).
  """

  def __init__(self, engine):
    self.engine = engine
    self.moves = 0
    self.seconds = 0.0

  def move(self, state, old: layout_lib.Layout, new: layout_lib.Layout):
    """The state moved from layout `old` to `new` (same values, new owners; `state` is
    consumed)."""
    return self.engine.move(state, old, new, donate=True)

  def compile(self, state, old: layout_lib.Layout, new: layout_lib.Layout) -> None:
    """Compiles every move from `old`'s bucket to `new`'s (`Engine.compile_moves`), of the
    state and of its parameters alone (a priority snapshot)."""
    self.engine.compile_moves(state, old, new)
    self.engine.compile_moves(state.params, old, new)

  def timed_move(self, state, old: layout_lib.Layout, new: layout_lib.Layout, priority=None):
    """(moved state, seconds of the slowest process): a move of the training loop, counted;
    the priority snapshot of `priority` (if any) moves with the state."""
    t0 = time.perf_counter()
    state = self.move(state, old, new)
    if priority is not None:
      priority.move_snapshot(lambda tree: self.move(tree, old, new))
    jax.block_until_ready(state)
    seconds = time.perf_counter() - t0
    self.moves += 1
    self.seconds += seconds
    return state, self.shared(seconds)

  @staticmethod
  def shared(seconds: float) -> float:
    """The slowest process's seconds (decision inputs must be the same on every process)."""
    return speed_lib.gather_times({}, seconds)[1]
