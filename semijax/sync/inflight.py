"""In-flight replica state on the host: layout-independent copies for checkpoints.

The replica modes keep state that a synchronous run does not: gradients computed but not yet
applied (ssaw, async), each replica's own parameters and optimizer state (local SGD). They are
padded, stacked trees [R, *P] on the devices. A checkpoint stores them in *logical* form on the
host, [R, *L] numpy with every unit axis in logical unit order (no padding), so a run resumes
onto any layout; `to_logical` / `to_padded` convert with the layout's slot indices.

`forms(engine)` gives the conversion for an engine: `UnitForms` for the tensor-parallel engine
(`core.engine`, the slot indices above), `PipeForms` for the pipelined one (`core.pipeline`:
each replica's row through the engine's own migration to its logical form, so a pipelined run
resumes onto another partition of its layers or units).

This goes through host memory: right for the models this repository trains on CPUs; a large
model would convert on the devices (the engine's migration collective) instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from semijax.core import engine as engine_lib
from semijax.core import layout as layout_lib
from semijax.core import pipeline as pipeline_lib
from semijax.core import sharding as sharding_lib


def _elements(index: np.ndarray, unit_size: int) -> np.ndarray:
  """Element positions of units/slots `index` along an axis with `unit_size` entries each."""
  return (np.asarray(index)[:, None] * unit_size + np.arange(unit_size)).reshape(-1)


def to_logical(tree, axes, layout: layout_lib.Layout, unit_sizes: dict, *, leading: int = 1):
  """Host numpy logical copy of a padded tree.

  Args:
    tree: padded arrays shaped like the parameters, with `leading` extra leading axes
      (e.g. [R, *P] for stacked replicas); device or numpy.
    axes: the parameters' `sharding.Axes` tree (a prefix of `tree`).
    layout: the layout `tree` is padded in.
    unit_sizes: {kind: entries per unit}.
    leading: how many leading axes come before the parameter's own.
  """
  kinds = layout.kinds()

  def one(a: sharding_lib.Axes, x):
    x = np.asarray(jax.device_get(x))
    if (unit := a.unit()) is None:
      return x
    axis, kind = unit
    return np.take(x, _elements(kinds[kind].unit_slots(), unit_sizes[kind]), axis=axis + leading)
  return jax.tree.map(one, axes, tree)


def to_padded(tree, axes, layout: layout_lib.Layout, unit_sizes: dict, *, leading: int = 1):
  """Host numpy padded copy, in `layout`, of a logical tree from `to_logical` (padding = 0)."""
  kinds = layout.kinds()

  def one(a: sharding_lib.Axes, x):
    x = np.asarray(x)
    if (unit := a.unit()) is None:
      return x
    axis, kind = unit
    u = kinds[kind]
    size = unit_sizes[kind]
    slots = u.slot_units()                                  # [N*C], -1 = padding
    out_shape = list(x.shape)
    out_shape[axis + leading] = len(slots) * size
    out = np.zeros(out_shape, x.dtype)
    owned = np.flatnonzero(slots >= 0)
    dst = _elements(owned, size)
    src = _elements(slots[owned], size)
    index = [slice(None)] * x.ndim
    index[axis + leading] = dst
    out[tuple(index)] = np.take(x, src, axis=axis + leading)
    return out
  return jax.tree.map(one, axes, tree)


def put(tree, shardings):
  """Host arrays -> device arrays placed with `shardings` (a matching tree)."""
  return jax.tree.map(jax.device_put, tree, shardings)


def state_to_logical(state, tx, axes, layout: layout_lib.Layout, unit_sizes: dict, *,
                     leading: int = 1):
  """`to_logical` of a (stacked) TrainState-like (params, opt_state) pair, as a dict."""
  one = lambda x, a: to_logical(x, a, layout, unit_sizes, leading=leading)
  return {"params": to_logical(state.params, axes, layout, unit_sizes, leading=leading),
          "opt_state": sharding_lib.map_params(tx, one, state.opt_state, axes,
                                               non_params=lambda x: np.asarray(x))}


def state_to_padded(logical: dict, tx, axes, layout: layout_lib.Layout, unit_sizes: dict, *,
                    leading: int = 1) -> tuple:
  """(params, opt_state) host padded copies of a `state_to_logical` dict."""
  one = lambda x, a: to_padded(x, a, layout, unit_sizes, leading=leading)
  return (to_padded(logical["params"], axes, layout, unit_sizes, leading=leading),
          sharding_lib.map_params(tx, one, logical["opt_state"], axes,
                                  non_params=lambda x: np.asarray(x)))


def flat(tree) -> dict:
  """A tree's leaves as {"0": leaf, "1": ...} (checkpoint-safe: no tuples, no int keys)."""
  return {str(i): np.asarray(jax.device_get(x)) for i, x in enumerate(jax.tree.leaves(tree))}


def unflat(template, leaves: dict):
  """The tree of `template`'s structure holding `flat`'s leaves."""
  n = len(jax.tree.leaves(template))
  if len(leaves) != n:
    raise ValueError(f"checkpoint: {len(leaves)} in-flight arrays, but this run keeps {n}")
  return jax.tree.unflatten(jax.tree.structure(template), [leaves[str(i)] for i in range(n)])


# --- one interface for both engines ---------------------------------------------------------------


class UnitForms:
  """In-flight trees of a tensor-parallel `engine.Engine` <-> flat host logical copies.

  `tree`s are parameter-shaped or `TrainState`s, with `leading` replica axes ([R, *P]: 1;
  [*P]: 0); `layout` the engine's `Layout`.
  """

  def __init__(self, engine: engine_lib.Engine):
    self.engine = engine

  def to_host(self, tree, layout, *, leading: int = 1) -> dict:
    """`flat` of the logical copy of a padded device tree."""
    e = self.engine
    if isinstance(tree, engine_lib.TrainState):
      return flat(state_to_logical(tree, e.tx, e.axes, layout, e.unit_sizes, leading=leading))
    return flat(to_logical(tree, e.axes, layout, e.unit_sizes, leading=leading))

  def to_device(self, leaves: dict, like, layout, shardings, *, leading: int = 1):
    """`to_host`'s leaves, padded in `layout` and placed with `shardings`; `like` is a device
    tree of the same structure (the run's current one)."""
    e = self.engine
    if isinstance(like, engine_lib.TrainState):
      logical = unflat({"params": like.params, "opt_state": like.opt_state}, leaves)
      params, opt = state_to_padded(logical, e.tx, e.axes, layout, e.unit_sizes, leading=leading)
      return put(engine_lib.TrainState(params, opt), shardings)
    logical = unflat(e.axes, leaves)
    return put(to_padded(logical, e.axes, layout, e.unit_sizes, leading=leading), shardings)


class PipeForms:
  """`UnitForms` for a `pipeline.PipelineEngine` (`layout` a `PipeLayout`): every replica's row
  goes through the engine's migration (`to_logical` / `to_padded`) on its own."""

  def __init__(self, engine: pipeline_lib.PipelineEngine):
    self.engine = engine

  def _plain_shardings(self, tree):
    e = self.engine
    if isinstance(tree, engine_lib.TrainState):
      return e.state_shardings(tree.params)
    return e.param_shardings

  def _rows(self, tree, leading: int) -> list:
    if not leading:
      return [tree]
    n = jax.tree.leaves(tree)[0].shape[0]
    return [jax.tree.map(lambda x, r=r: x[r], tree) for r in range(n)]

  def to_host(self, tree, layout, *, leading: int = 1) -> dict:
    e = self.engine
    rows = []
    for row in self._rows(tree, leading):
      row = jax.device_put(row, self._plain_shardings(row))
      # A row sliced off a stacked tree is a copy to donate; an unstacked tree is the run's
      # own (device_put of an array already so placed returns that array).
      rows.append(jax.device_get(e.to_logical(row, layout, donate=bool(leading))))
    host = rows[0] if not leading else jax.tree.map(lambda *x: np.stack(x), *rows)
    return flat(host)

  def to_device(self, leaves: dict, like, layout, shardings, *, leading: int = 1):
    e = self.engine
    host = unflat(like, leaves)
    rows = []
    for row in self._rows(host, leading):
      row = jax.device_put(row, self._plain_shardings(row))
      rows.append(e.to_padded(row, layout, donate=True))
    tree = rows[0] if not leading else jax.tree.map(lambda *x: jnp.stack(x), *rows)
    return jax.device_put(tree, shardings)


def forms(engine) -> UnitForms | PipeForms:
  """The in-flight conversions of `engine`'s kind."""
  if isinstance(engine, pipeline_lib.PipelineEngine):
    return PipeForms(engine)
  return UnitForms(engine)
