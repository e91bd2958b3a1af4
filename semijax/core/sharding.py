"""Logical parameter axes, their placement on the mesh, and packing of whole parameter trees.

Every parameter names its dimensions with logical axes (`Axes`): "embed", "vocab", ... stay
replicated; the unit axes "mlp" and "heads" are split over the `tensor` mesh axis with an uneven
`layout.UnitLayout`. Parameters are plain nested dicts of arrays (`nnx.to_pure_dict`), and an
`axes` tree of the same structure holds one `Axes` per parameter.

Two forms of the same parameters exist:
  * logical: unit axes have U*unit_size entries in logical unit order (layout-independent; what
    checkpoints and the dense reference hold);
  * padded: unit axes have N*C*unit_size entries, device-major (what the TP step computes on).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib

# Logical axis -> mesh axis. Axes not listed are replicated. "layers" is the stacked layer axis
# of a pipelined state (`core.pipeline`), split over the pipeline stages.
RULES = {"mlp": mesh_lib.TENSOR, "heads": mesh_lib.TENSOR, "layers": mesh_lib.PIPE}


@dataclasses.dataclass(frozen=True)
class Axes:
  """The logical axis names of one parameter, e.g. ("embed", "mlp"); None = unnamed."""

  names: tuple[str | None, ...]

  def unit(self, kinds=layout_lib.KINDS) -> tuple[int, str] | None:
    """(axis index, kind) of the unit axis among `kinds` (default the tensor-parallel kinds), or
    None for a parameter without one."""
    hits = [(i, n) for i, n in enumerate(self.names) if n in kinds]
    if len(hits) > 1:
      raise ValueError(f"parameter axes {self.names} name more than one unit axis")
    return hits[0] if hits else None

  def spec(self) -> P:
    return P(*(RULES.get(n) for n in self.names))


def block_index(path) -> int | None:
  """The block a parameter belongs to: the integer key after "blocks" in its tree path."""
  keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
  for a, b in zip(keys, keys[1:]):
    if a == "blocks":
      return int(b)
  return None


def axes_tree(abstract_state) -> dict:
  """The `Axes` of every parameter of an nnx state, as a pure dict (metadata key `axes`)."""
  def one(v):
    names = getattr(v, "axes", None)
    return Axes(tuple(names) if names is not None else (None,) * len(v.shape))
  mapped = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(mapped)


def specs(axes: Any) -> Any:
  """PartitionSpec of every parameter (padded form)."""
  return jax.tree.map(lambda a: a.spec(), axes)


def shardings(axes: Any, mesh: jax.sharding.Mesh) -> Any:
  return jax.tree.map(lambda a: NamedSharding(mesh, a.spec()), axes)


def slot_index(layout: layout_lib.Layout) -> dict:
  """{kind: int32 [N*C]} logical unit of each padded slot (-1 = padding): `pack_tree` input."""
  return {k: jnp.asarray(u.slot_units()) for k, u in layout.kinds().items()}


def unit_index(layout: layout_lib.Layout) -> dict:
  """{kind: int32 [U]} padded slot of each logical unit: `unpack_tree` input."""
  return {k: jnp.asarray(u.unit_slots()) for k, u in layout.kinds().items()}


def pack_tree(tree, axes, slots: dict, unit_sizes: dict):
  """Logical tree -> padded tree (also for param-shaped optimizer moments).

  Args:
    tree: logical arrays; unit axes hold U*unit_size entries.
    axes: the `Axes` tree of the parameters.
    slots: {kind: int32 [N*C]} from `slot_index`; may be traced, so one compile serves every
      layout with the same shapes.
    unit_sizes: {kind: entries per unit}, e.g. {"mlp": 1, "heads": head_dim} (static).
  """
  def one(a, x):
    unit = a.unit()
    if unit is None:
      return x
    axis, kind = unit
    return layout_lib.pack_axis(x, slots[kind], axis, unit_sizes[kind], x.shape[axis])
  return jax.tree.map(one, axes, tree)


def unpack_tree(tree, axes, units: dict, unit_sizes: dict):
  """Padded tree -> logical tree; `units` = {kind: int32 [U]} from `unit_index`."""
  def one(a, x):
    unit = a.unit()
    if unit is None:
      return x
    axis, kind = unit
    return layout_lib.unpack_axis(x, units[kind], axis, unit_sizes[kind])
  return jax.tree.map(one, axes, tree)


def map_params(tx: optax.GradientTransformation, fn, opt_state, axes, non_params=lambda x: x):
  """Applies fn(leaf, Axes) to the parameter-shaped leaves of an optax state (mu, nu, ...).

  `axes` may be any tree shaped like the parameters; `non_params` maps the other leaves.
  """
  return optax.tree_utils.tree_map_params(tx, fn, opt_state, axes,
                                          transform_non_params=non_params)


def opt_shardings(tx: optax.GradientTransformation, params_abstract, axes,
                  mesh: jax.sharding.Mesh) -> Any:
  """Shardings of `tx`'s state for parameters shaped like `params_abstract`: each moment placed
  like its parameter, the other leaves (counts) replicated."""
  opt = jax.eval_shape(tx.init, params_abstract)
  replicated = NamedSharding(mesh, P())
  return map_params(tx, lambda x, a: NamedSharding(mesh, a.spec()), opt, axes,
                    lambda x: replicated)
