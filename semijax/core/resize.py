"""ZERO-resizing: a slow device computes only part of its work for a while (docs/uneven_tp.md).

This module is the mechanism (what a resized step computes and updates); whom to resize and how
(`balance.resize.ResizeSpec`) and which units to keep (`balance.priority`) are balancing.

Two modes (`MODES`):
  * "units": the device skips a subset of its owned MLP units and heads in a layer, so both GEMMs
    of the block (forward, input gradient and weight gradient) shrink for it;
  * "contraction" (the authors' variant): the device skips part of the contraction dimension of
    each local GEMM (the d_model input features of the column-parallel GEMMs, the units of the
    row-parallel one); output shapes are kept, the device returns a partial sum.

What the skipped part contributes instead (`imputation`): "zero"; "fill" (a constant, the
authors' 1e-18, written into the skipped weight-gradient slots); "rescale" (the kept partial sum
times full/kept, so its expectation matches the full one). `freeze` keeps skipped weights and their
optimizer moments exactly as they were for that step (Adam moments applied to a zero gradient
would otherwise still move them).

Which units are skipped is chosen on the host (`balance.priority`) and handed to the step as a
`Resize` (data, so a new choice or keep ratio never recompiles). Evaluation never resizes.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from semijax.core import sharding


MODES = ("units", "contraction")
IMPUTATIONS = ("zero", "fill", "rescale")
DEFAULT_FRACTIONS = (0.25, 0.5, 0.75, 1.0)


def kept_count(keep: float, active: int) -> int:
  """Units (or features) kept out of `active` at ratio `keep`: ceil, at least 1 if any."""
  if keep >= 1.0 or active == 0:
    return active
  return max(1, min(active, math.ceil(keep * active - 1e-9)))


def fraction_index(keep: float, fractions: tuple[float, ...]) -> int:
  """Index of the smallest compiled fraction >= keep."""
  return next(i for i, f in enumerate(fractions) if f >= keep - 1e-9)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=("order", "kept", "skip", "feats", "feats_kept", "feat_skip", "frac"),
    meta_fields=("mode", "imputation", "fill_value", "freeze", "fractions"))
@dataclasses.dataclass(frozen=True)
class Resize:
  """What every tensor device skips in every layer this step (global arrays, split over tensor).

  Per unit kind (N devices, L layers, C slots, D = d_model):
    order: int32 [N, L, C] local slots, kept ones first (ascending), then the skipped, then the
      rest; the identity when nothing is skipped.
    kept: int32 [N, L] slots computed (units mode) or summed by the row GEMM (contraction).
    skip: bool [N, L, C] owned-and-active slots skipped this step.
    feats: int32 [N, L, D] contraction mode: input features, kept first ({} in units mode).
    feats_kept: int32 [N, L]; feat_skip: bool [N, L, D] (contraction mode, else {}).
    frac: int32 [N, L] contraction mode: index into `fractions` ({} in units mode).
  Static: mode, imputation, fill_value, freeze, fractions.
  """

  order: dict
  kept: dict
  skip: dict
  feats: dict
  feats_kept: dict
  feat_skip: dict
  frac: dict
  mode: str = "units"
  imputation: str = "zero"
  fill_value: float = 1e-18
  freeze: bool = True
  fractions: tuple = DEFAULT_FRACTIONS

  @property
  def rescale(self) -> bool:
    return self.imputation == "rescale"

  def layer(self, i: int) -> "Resize":
    """Layer i's arrays ([N, ...]; [1, ...] inside shard_map)."""
    return jax.tree.map(lambda a: a[:, i], self)


# --- parameters touched by resizing -------------------------------------------------------------

def role(axes) -> str | None:
  """"col" (column-parallel weight [d_model, units, ...]), "bias", "row" ([units, ..., d_model])
  or None. (A Llama's attention weights have a trailing or middle axis inside each unit.)"""
  unit = axes.unit()
  if unit is None:
    return None
  axis, _ = unit
  if len(axes.names) == 1:
    return "bias"
  return "col" if axis == 1 else "row"


def skip_masks(resize: Resize, active: dict, axes, unit_sizes: dict):
  """Per parameter, bool (padded, global shape or broadcastable): entries skipped this step.

  Args:
    resize: the step's `Resize` (global arrays).
    active: {kind: int32 [N]} computed slots per device (the plan's).
    axes: the `sharding.Axes` tree of the parameters.
    unit_sizes: {kind: entries per unit}.

  Returns:
    A tree like the parameters with a bool array (a scalar False where nothing is skipped).
  """
  never = jnp.zeros((), bool)
  def one(path, a):
    r = role(a)
    layer = sharding.block_index(path)
    if r is None or layer is None:
      return never
    axis, kind = a.unit()
    us = unit_sizes[kind]
    trailing = (1,) * (len(a.names) - 1 - axis)      # the axes after the unit axis broadcast
    units = jnp.repeat(resize.skip[kind][:, layer].reshape(-1), us)          # [N*C*us]
    if resize.mode == "units" or r == "row":
      return units.reshape(units.shape + trailing)
    if r == "bias":
      return never
    n, c = resize.skip[kind].shape[0], resize.skip[kind].shape[2]
    owned = jnp.arange(c)[None, :] < active[kind][:, None]                  # [N, C]
    feat = resize.feat_skip[kind][:, layer]                                 # [N, D]
    mask = feat.T[:, :, None] & jnp.repeat(owned, us, axis=1)[None]          # [D, N, C*us]
    return mask.reshape((mask.shape[0], n * c * us) + trailing)
  return jax.tree_util.tree_map_with_path(one, axes)


def _where(masks, a, b):
  """a where masked else b, leaf by leaf."""
  return jax.tree.map(jnp.where, masks, a, b)


def impute_gradients(resize: Resize, masks, grads):
  """The "fill" imputation: `fill_value` in the skipped weight-gradient slots."""
  if resize.imputation != "fill":
    return grads
  fill = jax.tree.map(lambda g: jnp.full_like(g, resize.fill_value), grads)
  return _where(masks, fill, grads)


def freeze(resize: Resize, masks, new, old):
  """`new` with the skipped entries taken from `old` (for params and param-shaped moments)."""
  return _where(masks, old, new) if resize.freeze else new
