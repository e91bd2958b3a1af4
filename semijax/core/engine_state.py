"""The engine's train state and its two forms: `TrainState`, and `StateForms`, the `Engine` mixin
that initializes a state and moves it between its logical and padded forms.

Two forms of one state, both sharded over `tensor` (no device ever holds all of it):
  padded: in a run's layout (`Layout`), what the steps compute on;
  logical: in the canonical layout (`Layout.canonical`): every unit axis in logical unit order,
    zeros appended up to N*ceil(U/N) units when N does not divide U. It is layout-independent
    (checkpoints hold it) and, as a padded form itself, it moves to and from any layout with
    the migration collective, group by group (`migrate.Migrator.move_groups`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from semijax.core import layout as layout_lib
from semijax.core import migrate
from semijax.core import sharding


@functools.partial(jax.tree_util.register_dataclass, data_fields=("params", "opt_state"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Parameters (pure dict) and optax state; padded or logical depending on context."""

  params: Any
  opt_state: Any


class StateForms:
  """The logical and padded forms of an engine's state and the moves between them (see module
  doc). A mixin of `engine.Engine`, whose callers use these methods on the engine itself; it reads
  the engine's `model_fn`, `tx`, `axes`, `unit_sizes`, `num_units`, `mesh`, `tensor_size`,
  `param_shardings` and `check_layout`."""

  # Built on first use, one per engine (so runs that reuse an engine reuse their programs).
  _init_fn = None
  _migrator = None
  _abstract = None

  def migrator(self):
    """This engine's `migrate.Migrator` (one per engine, so its compiled moves are reused)."""
    if self._migrator is None:
      self._migrator = migrate.Migrator.for_engine(self)
    return self._migrator

  @property
  def logical_layout(self) -> layout_lib.Layout:
    """The canonical layout of the sharded logical form (see module doc)."""
    return layout_lib.Layout.canonical(self.num_units, self.tensor_size)

  def _init_logical(self, seed) -> TrainState:
    """The logical state from `seed` (an int or a key), unit axes padded to the canonical
    layout's slots."""
    params = nnx.to_pure_dict(nnx.split(self.model_fn(nnx.Rngs(seed)))[1])
    state = TrainState(params, self.tx.init(params))
    slots = {k: u.num_slots * self.unit_sizes[k] for k, u in self.logical_layout.kinds().items()}

    def pad(x, a):
      if (unit := a.unit()) is None:
        return x
      axis, kind = unit
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, slots[kind] - x.shape[axis])
      return jnp.pad(x, widths)
    return TrainState(jax.tree.map(pad, state.params, self.axes),
                      sharding.map_params(self.tx, pad, state.opt_state, self.axes))

  def init_logical(self, seed: int) -> TrainState:
    """The sharded logical state from `seed` (parameters and optimizer state). Computed under
    its output sharding, so each device builds only its share (no replicated copy). The seed's
    key goes in as data (host numpy, the same on every process), so one program serves every
    seed: runs that reuse an engine do not compile their initialization again."""
    if self._init_fn is None:
      self._init_fn = jax.jit(lambda data: self._init_logical(jax.random.wrap_key_data(data)),
                              out_shardings=self.logical_shardings())
    return self._init_fn(np.asarray(jax.random.key_data(jax.random.key(seed))))

  def _shapes(self) -> TrainState:
    """Shapes and dtypes of the logical state (its initialization traced once per engine: about
    a second for a GPT-2 small)."""
    if self._abstract is None:
      self._abstract = jax.eval_shape(functools.partial(self._init_logical, 0))
    return self._abstract

  def abstract_logical(self) -> TrainState:
    """Shapes, dtypes and shardings of the sharded logical state: a restore target."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self._shapes(), self.logical_shardings())

  def logical_shardings(self) -> TrainState:
    return self.state_shardings(self._shapes().params)

  def state_shardings(self, params_abstract) -> TrainState:
    return TrainState(self.param_shardings,
                      sharding.opt_shardings(self.tx, params_abstract, self.axes, self.mesh))

  def tree_axes(self, tree):
    """The `Axes` tree of a `TrainState` (moments get their parameter's axes) or of a
    parameter-shaped tree."""
    if isinstance(tree, TrainState):
      return migrate.state_axes(tree, self.tx, self.axes)
    return self.axes

  def move(self, tree, old: layout_lib.Layout, new: layout_lib.Layout, *,
           donate: bool = False, chunk="sized"):
    """A `TrainState` (or a parameter-shaped tree) padded in `old`, padded in `new`: the
    migration collective, one (block, kind) group of weights and moments at a time; `donate`
    consumes `tree` group by group."""
    self.check_layout(old)
    self.check_layout(new)
    moves = migrate.plan(old, new, chunk=chunk)
    axes = self.tree_axes(tree)
    return self.migrator().move_groups(tree, axes, moves, migrate.leaf_groups(tree, axes),
                                       donate=donate)

  def compile_moves(self, state, old: layout_lib.Layout, new: layout_lib.Layout) -> None:
    """Compiles every migration `move` may run from `old`'s bucket to `new`'s: each unit kind's
    group programs at every chunk size (`migrate.chunk_sizes`) and at none (nothing of that kind
    moves). `state` is padded in `old`; `new` is a layout one small move away from it."""
    axes = self.tree_axes(state)
    groups = migrate.leaf_groups(state, axes)
    mig = self.migrator()
    nothing, *chunks = migrate.chunk_options(old, new)
    # Nothing moves (K = 0): one layout's owners in both buckets (whichever bucket holds them).
    options = [migrate.plan(*migrate.same_owners(old, new), chunk=nothing)]
    options += [migrate.plan(old, new, chunk=c) for c in chunks]
    for moves in options:
      mig.compile_groups(state, axes, moves, groups, donate=True)

  def to_padded(self, logical, layout: layout_lib.Layout, *, donate: bool = False):
    """The logical state (params + optimizer moments, or a parameter-shaped tree) padded in
    `layout`."""
    return self.move(logical, self.logical_layout, layout, donate=donate)

  def to_logical(self, padded, layout: layout_lib.Layout, *, donate: bool = False):
    """A padded state (or parameter-shaped tree) of `layout` in the sharded logical form."""
    return self.move(padded, layout, self.logical_layout, donate=donate)

  def logical_arrays(self, logical) -> Any:
    """Host numpy copies of a logical tree (params- or state-shaped) with exactly U units on
    every unit axis (the canonical padding cut off): for tests, inspection and small models."""
    units = {k: n * self.unit_sizes[k] for k, n in self.num_units.items()}
    axes = self.tree_axes(logical)

    def cut(x, a):
      x = np.asarray(jax.device_get(x))
      if (unit := a.unit()) is None:
        return x
      axis, kind = unit
      return np.take(x, np.arange(units[kind]), axis=axis)
    return jax.tree.map(cut, logical, axes)

  def init(self, seed: int, layout: layout_lib.Layout) -> TrainState:
    """A padded train state for `layout`, identical in logical form for every layout."""
    return self.to_padded(self.init_logical(seed), layout, donate=True)

  def relayout(self, state: TrainState, old: layout_lib.Layout,
               new: layout_lib.Layout, *, donate: bool = False, chunk="sized") -> TrainState:
    """Moves a padded state from layout `old` to layout `new` (`move`; `chunk=None`: one
    executable serves every pair of layouts of the two buckets)."""
    return self.move(state, old, new, donate=donate, chunk=chunk)
