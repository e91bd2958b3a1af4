"""Uneven tensor-parallel blocks: a column->row parallel block on each device's units, one psum.

`row_parallel` is what the model layers call inside `jax.shard_map`. It runs this device's
partial block (`kernels.mlp_partial`, `kernels.attention_partial`) at its bucket width (a
`lax.switch`, or the pallas kernel's one program: `plan.kernel`), or its ZERO-resized variant
(`plan.resize`), or the authors' offload path (`plan.offload`, see `core.offload`), and
all-reduces. (`plan.executed_widths` mirrors, on the host, the width each
device executes here.)
"""

from __future__ import annotations

import math
from typing import Callable

import jax
import jax.numpy as jnp

from semijax.core import kernels
from semijax.core import mesh as mesh_lib
from semijax.core import offload as offload_lib
from semijax.core.plan import Plan

# The name scope of the split work of a block (what balancing moves between devices), so that
# a profile can tell it from the work every device repeats (benchmarks/breakdown.py).
BLOCK_SCOPE = "tp_block"


def _resized(plan: Plan, kind: str, fn: Callable, x, weights, active):
  """The partial output of one device under a `resize.Resize` plan.

  Branches: the exact block at every bucket width (a device that is not resized runs exactly
  the code of a plan without resizing, so keep 1.0 changes nothing, bit for bit), then the
  resized variants: units mode at every width of the kept count; contraction mode at every
  (owned width, kept fraction) pair, the fraction setting both contractions.
  """
  r = plan.resize
  widths = plan.widths_of(kind)
  d_model = x.shape[-1]
  order, kept = r.order[kind][0], r.kept[kind][0]
  contraction = r.mode == "contraction"
  if contraction:
    feats, feats_kept, frac = r.feats[kind][0], r.feats_kept[kind][0], r.frac[kind][0]
    resized = (kept < active) | (feats_kept < d_model)
    cuts = tuple((w, f) for w in widths for f in r.fractions)
    cut_index = kernels.bucket_index(active, widths) * len(r.fractions) + frac
  else:
    feats = feats_kept = jnp.zeros((), jnp.int32)
    resized = kept < active
    cuts = tuple((w, 1.0) for w in widths)
    cut_index = kernels.bucket_index(kept, widths)
  scale = lambda full, part: jnp.where(part > 0, full / jnp.maximum(part, 1), 1.0).astype(
      x.dtype) if r.rescale else 1.0

  def run(variant, x, *args):
    *weights, order, kept, feats, feats_kept = args
    exact, width, f = variant
    if exact:
      return fn(width, x, *weights, active)
    if not contraction:
      return fn(width, x, *weights, active, kernels.Cut(order, kept, row_scale=scale(active, kept)))
    cut = kernels.Cut(order, kept, feats, feats_kept, col_scale=scale(d_model, feats_kept),
              row_scale=scale(active, kept), row_width=math.ceil(f * width),
              feat_width=math.ceil(f * d_model))
    return fn(width, x, *weights, active, cut)

  variants = tuple((True, w, 1.0) for w in widths) + tuple((False, w, f) for w, f in cuts)
  index = jnp.where(resized, len(widths) + cut_index, kernels.bucket_index(active, widths))
  return kernels.at_bucket(index, variants, run, x, *weights, order, kept, feats, feats_kept)


def row_parallel(plan: Plan, kind: str, fn: Callable, x, *weights, units=None):
  """Runs a column->row parallel block on this device's units and all-reduces the result.

  Args:
    plan: the local plan of this layer (inside shard_map; see `Plan.layer`).
    kind: "mlp" or "heads".
    fn: a partial function like `mlp_partial`: fn(width, x, *weights, active, cut).
    x: activations, replicated over `tensor`.
    weights: local padded blocks.
    units: per weight, static (unit axis, unit size) (`MLP_UNITS`, `attention_units`); needed
      when `plan.offload` is set (helpers gather the offloaded units of every weight).

  With `plan.offload`, the device computes its kept units at their bucket width and the units
  it helps with at the offload chunk width.

  Returns:
    The full block output, replicated over `tensor`.
  """
  active = plan.active[kind][0]
  widths = plan.widths_of(kind)
  # Make the replicated x varying over `tensor` (adding a zero that varies like `active`) once,
  # outside the per-device branches: then the all-reduce of its gradient is not inside every
  # branch, where a branch without one would leave the other devices waiting.
  x = x + (active * 0).astype(x.dtype)
  with jax.named_scope(BLOCK_SCOPE):
    if plan.offload is not None:
      if units is None or len(units) != len(weights):
        raise ValueError(f"tp.row_parallel.units: offload needs (axis, unit size) for each of "
                         f"the {len(weights)} weights of {kind}, got {units!r}")
      y, _ = offload_lib.block_partial(plan.offload[kind], widths, fn, x, weights, units)
    elif plan.runs_pallas(kind):
      y = fn(None, x, *weights, active)
    elif plan.resize is None:
      y = kernels.at_width(active, widths, fn, x, *weights, active)
    else:
      y = _resized(plan, kind, fn, x, weights, active)
  return jax.lax.psum(y, mesh_lib.TENSOR)
