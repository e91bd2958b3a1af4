"""The forms of a pipelined train state (`PipeStates`): the layouts a model's state may take on a
mesh, the sharded logical form (built from a seed, abstract, as host arrays), the padded form of
any `PipeLayout`, the moves between them (migrations, `core.migrate`) and their shardings.
`core.pipeline` has the design (see its module doc).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from semijax.core import mesh as mesh_lib
from semijax.core import migrate
from semijax.core import pipeline_model
from semijax.core import sharding
from semijax.core.engine import TrainState
from semijax.core.pipeline_layout import PipeLayout
from semijax.errors import LayoutError

PIPE, TENSOR = mesh_lib.PIPE, mesh_lib.TENSOR
SHARED, STACK = pipeline_model.SHARED, pipeline_model.STACK


class PipeStates:
  """Builds, checks and moves the states of one model pipelined on one mesh.

  Args:
    model: the model's parts (`pipeline_model.PipeModel`).
    mesh: a (data, pipe, tensor) mesh (`mesh.make_pipeline_mesh`).
    tx: the optax optimizer whose state a `TrainState` carries.
  """

  def __init__(self, model: pipeline_model.PipeModel, mesh: jax.sharding.Mesh,
               tx: optax.GradientTransformation):
    self.model, self.mesh, self.tx = model, mesh, tx
    self.stages, self.tensor_size = mesh.shape[PIPE], mesh.shape[TENSOR]
    self.param_shardings = sharding.shardings(model.axes, mesh)
    self._migrator = None
    self._abstract = None

  # --- layouts ----------------------------------------------------------------------------------

  @property
  def logical_layout(self) -> PipeLayout:
    m = self.model
    return PipeLayout.canonical(m.num_layers, m.num_units, self.stages, self.tensor_size)

  def check_layout(self, layout: PipeLayout) -> None:
    """Raises LayoutError unless `layout` fits this model and mesh."""
    num_layers, num_units = self.model.num_layers, self.model.num_units
    if layout.stages != self.stages or layout.layers.num_units != num_layers:
      raise LayoutError(f"layout.layers: {layout.layers.num_units} layers on {layout.stages} "
                        f"stages, but the model has {num_layers} on mesh.pipe = "
                        f"{self.stages}")
    for s, u in enumerate(layout.units):
      if u.num_devices != self.tensor_size:
        raise LayoutError(f"layout.units[{s}]: {u.num_devices} devices, but mesh.tensor = "
                          f"{self.tensor_size}")
      for kind, k in u.kinds().items():
        if k.num_units != num_units[kind]:
          raise LayoutError(f"layout.units[{s}].{kind}: {k.num_units} units, but the model has "
                            f"{num_units[kind]}")

  # --- the logical form -------------------------------------------------------------------------

  def _logical_init(self, seed: int) -> TrainState:
    """The canonical logical state from `seed` (`core.pipeline`'s doc), padded with zero
    rows/units."""
    m = self.model
    full = nnx.to_pure_dict(nnx.split(m.model_fn(nnx.Rngs(seed)))[1])
    blocks = [full["encoder"]["blocks"][i] for i in range(m.num_layers)]
    canon = self.logical_layout
    rows = canon.layers.num_slots
    unit_slots = {k: u.num_slots * m.unit_sizes[k] for k, u in canon.units[0].kinds().items()}

    def stack(*xs, a):
      x = jnp.stack(xs)
      widths = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
      if (unit := a.unit()) is not None:
        axis, kind = unit
        widths[axis + 1] = (0, unit_slots[kind] - x.shape[axis + 1])
      return jnp.pad(x, widths)

    stacked = jax.tree.map(lambda a, *xs: stack(*xs, a=a), m.block_axes, *blocks)
    params = {SHARED: pipeline_model.without_blocks(full), STACK: stacked}
    return TrainState(params, self.tx.init(params))

  def state_shardings(self, params_abstract) -> TrainState:
    """Shardings of a padded train state with parameters shaped like `params_abstract`."""
    return TrainState(self.param_shardings, sharding.opt_shardings(
        self.tx, params_abstract, self.model.axes, self.mesh))

  def _shapes(self) -> TrainState:
    """Shapes and dtypes of the logical state (its initialization traced once)."""
    if self._abstract is None:
      self._abstract = jax.eval_shape(functools.partial(self._logical_init, 0))
    return self._abstract

  def logical_shardings(self) -> TrainState:
    return self.state_shardings(self._shapes().params)

  def init_logical(self, seed: int) -> TrainState:
    """The sharded logical state from `seed`, built under its sharding (no replicated copy)."""
    return jax.jit(functools.partial(self._logical_init, seed),
                   out_shardings=self.logical_shardings())()

  def abstract_logical(self) -> TrainState:
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        self._shapes(), self.logical_shardings())

  def local_bytes(self, layout: PipeLayout) -> tuple[float, float]:
    """(block, replicated): parameter bytes one device holds in `layout` (its stage's layer
    slots, each with its kind's unit capacity, and the replicated embedding, norm and head)."""
    params = self.abstract_logical().params
    stack = 0.0
    for a, x in zip(jax.tree.leaves(self.model.block_axes), jax.tree.leaves(params[STACK])):
      shape = list(x.shape[1:])
      if (unit := a.unit()) is not None:
        axis, kind = unit
        shape[axis] = layout.units[0].kinds()[kind].capacity * self.model.unit_sizes[kind]
      stack += layout.layers.capacity * float(np.prod(shape)) * x.dtype.itemsize
    shared = sum(float(np.prod(x.shape)) * x.dtype.itemsize
                 for x in jax.tree.leaves(params[SHARED]))
    return stack, shared

  def logical_arrays(self, logical) -> Any:
    """Host numpy copies of a logical tree in the unpipelined model's form: {"encoder":
    {"blocks": {0: ..., ...}, ...}, ...} with exactly U units per unit axis."""
    m = self.model
    params = logical.params if isinstance(logical, TrainState) else logical
    units = {k: n * m.unit_sizes[k] for k, n in m.num_units.items()}

    def cut(x, a, layer):
      x = np.asarray(jax.device_get(x))[layer]
      if (unit := a.unit()) is None:
        return x
      axis, kind = unit
      return np.take(x, np.arange(units[kind]), axis=axis)

    return pipeline_model.with_blocks(
        jax.tree.map(lambda x: np.asarray(jax.device_get(x)), params[SHARED]), m.num_layers,
        lambda l: jax.tree.map(lambda x, a: cut(x, a, l), params[STACK], m.block_axes))

  # --- moves between layouts --------------------------------------------------------------------

  def tree_axes(self, tree):
    if isinstance(tree, TrainState):
      return migrate.state_axes(tree, self.tx, self.model.axes)
    return self.model.axes

  def migrator(self) -> migrate.Migrator:
    if self._migrator is None:
      self._migrator = migrate.Migrator(self.mesh, self.model.unit_sizes)
    return self._migrator

  def move(self, tree, old: PipeLayout, new: PipeLayout, *, donate: bool = False):
    """A state (or parameter-shaped tree) padded in `old`, padded in `new`: each stage's units
    to the canonical layout, the layers that change stage over `pipe`, then each stage's units to
    their new layout (steps, and unit kinds, that change nothing are skipped), leaf by leaf."""
    self.check_layout(old)
    self.check_layout(new)
    axes = self.tree_axes(tree)
    mig = self.migrator()
    canon = self.logical_layout.units[0]
    run = lambda t, moves, first: mig.move_groups(
        t, axes, moves, migrate.leaf_groups(t, axes, moves.changing_kinds(), by_leaf=True),
        donate=donate or not first)
    first = True
    if old.layers != new.layers:
      if any(u != canon for u in old.units):
        tree = run(tree, migrate.plan_stages(old.units, (canon,) * old.stages), first)
        first = False
      tree = run(tree, migrate.plan_layers(old.layers, new.layers), first)
      first = False
      old = old.with_units((canon,) * old.stages)
    if old.units != new.units:
      tree = run(tree, migrate.plan_stages(old.units, new.units), first)
    elif first and not donate:
      tree = jax.tree.map(lambda x: x.copy(), tree)
    return tree

  def to_padded(self, logical, layout: PipeLayout, *, donate: bool = False):
    return self.move(logical, self.logical_layout, layout, donate=donate)

  def to_logical(self, padded, layout: PipeLayout, *, donate: bool = False):
    return self.move(padded, layout, self.logical_layout, donate=donate)

  def init(self, seed: int, layout: PipeLayout) -> TrainState:
    return self.to_padded(self.init_logical(seed), layout, donate=True)
