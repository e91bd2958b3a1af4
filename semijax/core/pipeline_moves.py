"""Compiling ahead of time every migration program a pipelined re-plan may run inside one
compiled bucket (`PipeStates.move` between two layouts with the same layer slots and unit
capacities), so that a re-plan while training compiles nothing.

A move runs up to three phases, each a program per state leaf (`migrate.leaf_groups` by leaf),
keyed by the leaf's shape and its kind's (capacity from, capacity to, chunk K):

  units    every stage's units from the bucket to the canonical capacities (before a layer move)
           or to the bucket (a move of units only);
  layers   rows of the stacked layer axis between stages, in the canonical units;
  units    from the canonical capacities back to the bucket (after a layer move).

`migrate.plan_stages` and `plan_layers` size K from `migrate.chunk_sizes` of the smaller
capacity ("sized"), or 0 for a kind where nothing moves (a kind that neither moves nor changes
capacity is left out, `Moves.changing_kinds`): every such K of every phase is compiled here,
on abstract trees of each phase's shapes, with moves that change nothing (the programs take
the index arrays as arguments, so any move of the same key runs them).
"""

from __future__ import annotations

import jax

from semijax.core import layout as layout_lib
from semijax.core import migrate
from semijax.core.pipeline_layout import PipeLayout

LAYERS = layout_lib.LAYERS


def abstract_in(tree, axes, stages: int, layer_slots: int, units: layout_lib.Layout,
                unit_sizes: dict):
  """`tree`'s leaves (padded in any layout) as abstract arrays padded in `layer_slots` rows
  per stage ([stages * layer_slots] on the "layers" axis) and `units`' capacities ([N * C *
  unit size] on each unit axis), with their shardings."""
  tensor = units.num_devices

  def one(x, a):
    shape = list(x.shape)
    for i, name in enumerate(a.names):
      if name == LAYERS:
        shape[i] = stages * layer_slots
      elif name in layout_lib.KINDS:
        shape[i] = tensor * units.kinds()[name].capacity * unit_sizes[name]
    return jax.ShapeDtypeStruct(tuple(shape), x.dtype, sharding=x.sharding)

  return jax.tree.map(one, tree, axes)


def _unit_moves(src: layout_lib.Layout, dst: layout_lib.Layout, stages: int) -> list:
  """The stage moves of every chunk K a units phase from `src`'s bucket to `dst`'s may take
  (`migrate.chunk_options`), each moving nothing (`migrate.same_owners`)."""
  a, b = migrate.same_owners(src, dst)
  return [migrate.plan_stages((a,) * stages, (b,) * stages, chunk=c)
          for c in migrate.chunk_options(a, b)]


def compile_moves(states, state, layout: PipeLayout) -> int:
  """Compiles every program a move of `state` (padded in `layout`, or its abstract form)
  between two layouts of `layout`'s bucket may run (see module doc); returns how many were
  new. `states`: the `pipeline_state.PipeStates` whose migrator runs the moves."""
  mig, axes = states.migrator(), states.tree_axes(state)
  stages, slots = layout.stages, layout.layers.capacity
  here, canon = layout.units[0], states.logical_layout.units[0]
  sizes = states.model.unit_sizes
  in_here = abstract_in(state, axes, stages, slots, here, sizes)
  in_canon = abstract_in(state, axes, stages, slots, canon, sizes)
  before = mig.compile_count
  phases = [(in_here, m) for m in _unit_moves(here, canon, stages) + _unit_moves(here, here,
                                                                                 stages)]
  phases += [(in_canon, m) for m in _unit_moves(canon, here, stages)]
  phases += [(in_canon, migrate.plan_layers(layout.layers, layout.layers, chunk=k))
             for k in migrate.chunk_sizes(slots)]
  for tree, moves in phases:
    groups = migrate.leaf_groups(tree, axes, moves.changing_kinds(), by_leaf=True)
    mig.compile_groups(tree, axes, moves, groups, donate=True)
  return mig.compile_count - before
