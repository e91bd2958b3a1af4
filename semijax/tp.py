"""Column- and row-parallel operations with uneven, bucketed compute widths.

Everything here runs *inside* `jax.shard_map` on local blocks. A column-parallel GEMM followed by a
row-parallel GEMM (Megatron) produces, on every tensor device, a partial sum of the full output;
one `psum` over the `tensor` axis completes it.

Uneven work: device d computes only its first `active[d]` unit slots. Masking alone would still
run GEMMs at the capacity C, so each block is compiled at a few bucket widths (`Plan.widths`) and
`lax.switch` picks, per device and at run time, the smallest width >= active[d]. The branch index
is data, so changing counts or actives inside a capacity bucket never recompiles.

Each branch is rematerialized (`jax.checkpoint`) in the backward pass. Without it `lax.cond` keeps
the residuals of *every* branch, zero-filled for the branches not taken, which costs more than
the recomputed forward and makes small widths as slow as large ones.

Offload (`Plan.offload`, the authors' baseline, see `offload`): helpers compute some of a
straggler's units every step. `row_parallel` then runs `offload.block_partial`; `offload` imports
this module, so this module imports it lazily, inside the two functions that need it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax import hetero
from semijax import layout as layout_lib
from semijax import mesh as mesh_lib


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("active", "slowdown", "resize", "offload"),
                   meta_fields=("widths", "unit_ms"))
@dataclasses.dataclass(frozen=True)
class Plan:
  """What every tensor device computes in one step.

  Attributes:
    active: {kind: int32 [N]} leading slots each device computes ([1] locally in shard_map).
    slowdown: float32 [N] emulated slowdown factor per tensor device (1.0 = nominal), or None for
      no emulation ([1] locally).
    resize: a `resize.Resize` (ZERO-resizing: which units / features each device skips in each
      layer), or None for exact computation. Inside a block, `layer(i)` has sliced it to layer i.
    offload: {kind: `offload.OffloadPlan`} for every kind (the same in every layer), or None: which
      units each device sends to helpers and computes for others. Exact, so `exact()` keeps it.
    widths: ((kind, compute widths), ...), static: the compiled bucket widths.
    unit_ms: ((kind, ms), ...), static: emulated milliseconds per unit of executed width at
      slowdown 1 (forward plus backward); only used when `slowdown` is not None.
  """

  active: dict
  slowdown: jax.Array | None
  widths: tuple
  unit_ms: tuple = ()
  resize: object = None
  offload: dict | None = None

  def widths_of(self, kind: str) -> tuple[int, ...]:
    return dict(self.widths)[kind]

  def unit_ms_of(self, kind: str) -> float:
    return dict(self.unit_ms).get(kind, 0.0)

  def layer(self, i: int) -> "Plan":
    """The plan of block i: resize arrays [N, L, ...] sliced to [N, ...] (or [1, ...] locally)."""
    if self.resize is None:
      return self
    return dataclasses.replace(self, resize=self.resize.layer(i))

  def exact(self) -> "Plan":
    """The same plan without resizing (evaluation always computes every owned unit).

    Offload is kept: it computes exactly the same values, and balances evaluation steps too.
    """
    return dataclasses.replace(self, resize=None)


def uniform_widths(layout: layout_lib.Layout) -> dict | None:
  """{kind: (w,)} when, in every kind, every device executes the same bucket width w; else None.

  An exact step of such a layout needs no per-device branch: with these as the plan's widths
  it runs without `lax.switch` and without rematerializing the forward pass (about a third less
  block compute than the multi-width step of the same layout).
  """
  out = {}
  for kind, u in layout.kinds().items():
    executed = set(u.executed_widths())
    if len(executed) != 1:
      return None
    out[kind] = (executed.pop(),)
  return out


def make_plan(layout: layout_lib.Layout, mesh: jax.sharding.Mesh, *, slowdown=None,
              unit_ms: dict | None = None, resize=None, offload=None,
              widths: dict | None = None) -> Plan:
  """The device-placed plan for `layout` (every data leaf sharded over `tensor`).

  `resize` is a host-side `resize.Resize` (numpy leaves [N, L, ...]) or None.
  `offload` is None (no offload path) or {kind: {straggler: {helper: units}}}; a kind left out
  (or {}) offloads nothing but still runs the offload path, so that every amount, zero included,
  uses the same compiled step (`offload.static_shape`).
  `widths` ({kind: ascending compute widths}, default the layout's) narrows the compiled branches,
  e.g. to `uniform_widths(layout)`; the widest must cover every device's active count.

  Raises:
    ValueError: `offload` with an unknown kind, or together with `resize` (not supported);
      `widths` that do not cover an active count or exceed the capacity.
    LayoutError: `offload.<kind>` with a bad straggler, helper or share (`offload.make_plan`).
  """
  if offload is not None and resize is not None:
    raise ValueError("offload: cannot be combined with resize (a resized device's kept units "
                     "are a permutation, offload sends its last active slots); pass one of them")
  kind_widths = {k: u.widths for k, u in layout.kinds().items()}
  for kind, w in (widths or {}).items():
    u = layout.kinds().get(kind)
    w = tuple(int(x) for x in w)
    if (u is None or not w or list(w) != sorted(set(w)) or w[0] < 1 or w[-1] > u.capacity
        or w[-1] < max(u.active)):
      raise ValueError(f"widths.{kind}: {w} must be ascending widths of a layout kind, at most "
                       f"its capacity and covering every active count ({layout.to_json()})")
    kind_widths[kind] = w
  shard = NamedSharding(mesh, P(mesh_lib.TENSOR))
  put = lambda x: jax.device_put(x, shard)
  active = {k: put(np.asarray(u.active, np.int32)) for k, u in layout.kinds().items()}
  if slowdown is not None:
    slowdown = put(np.asarray(slowdown, np.float32))
  if resize is not None:
    resize = jax.tree.map(put, resize)
  if offload is not None:
    offload = _offload_plans(layout, mesh, offload)
  return Plan(active, slowdown, tuple(kind_widths.items()),
              tuple(sorted((unit_ms or {}).items())), resize, offload)


def branch_plans(plan: Plan, mesh: jax.sharding.Mesh) -> list[Plan]:
  """Plans under which every device takes each branch of `plan`'s compiled step once.

  XLA:CPU pays a one-time cost (about 0.2 s here) the first time a branch of a compiled step
  runs; a warm-up that runs these plans pays it instead of the first timed step after a change.
  Their results are meaningless (actives need not sum to the units): run them on a throwaway
  state. Covers the exact branches at every width and, for a units-mode resize, the resized ones.
  """
  shard = NamedSharding(mesh, P(mesh_lib.TENSOR))
  put = lambda x: jax.device_put(x, shard)
  n = len(next(iter(plan.active.values())))
  widths = dict(plan.widths)
  full = lambda w: put(np.full(n, w, np.int32))
  out = []
  for i in range(max(len(w) for w in widths.values())):
    at = {k: w[min(i, len(w) - 1)] for k, w in widths.items()}
    active = {k: full(at[k]) for k in widths}
    if plan.resize is None:
      out.append(dataclasses.replace(plan, active=active))
      continue
    r = plan.resize
    kept = {k: put(np.full(r.kept[k].shape, at[k], np.int32)) for k in widths}
    out.append(dataclasses.replace(plan, active=active, resize=dataclasses.replace(r, kept=kept)))
    if r.mode == "units" and any(at[k] < widths[k][-1] for k in widths):
      cap = {k: full(w[-1]) for k, w in widths.items()}     # kept < active: resized branch
      out.append(dataclasses.replace(plan, active=cap, resize=dataclasses.replace(r, kept=kept)))
  return out


def _offload_plans(layout: layout_lib.Layout, mesh, offload: dict) -> dict:
  """{kind: placed OffloadPlan} with amount-independent statics, for every kind of `layout`."""
  from semijax import offload as offload_lib   # lazy: offload imports tp
  kinds = layout.kinds()
  if not isinstance(offload, dict) or set(offload) - set(kinds):
    raise ValueError(f"offload: expected {{kind: {{straggler: {{helper: units}}}}}} with kinds "
                     f"in {sorted(kinds)}, got {offload!r}")
  out = {}
  for kind, u in kinds.items():
    rounds, chunk = offload_lib.static_shape(u)
    out[kind] = offload_lib.make_plan(u, offload.get(kind, {}), mesh, chunk=chunk,
                                      rounds=rounds)
  return out


def plan_specs(plan: Plan) -> Plan:
  """shard_map in_specs for a plan: every data leaf is split over `tensor`."""
  return jax.tree.map(lambda _: P(mesh_lib.TENSOR), plan)


def bucket_index(active: jax.Array, widths: tuple[int, ...]) -> jax.Array:
  """Index of the smallest width >= active (int32 scalar); widths are ascending."""
  return jnp.sum(active > jnp.asarray(widths[:-1], active.dtype)).astype(jnp.int32)


def at_bucket(index: jax.Array, variants: tuple, fn: Callable, *operands):
  """Runs `fn(variants[index], *operands)`: static variants, a traced index (see module doc)."""
  if len(variants) == 1:
    return fn(variants[0], *operands)
  branches = [jax.checkpoint(functools.partial(fn, v)) for v in variants]
  return jax.lax.switch(index, branches, *operands)


def at_width(active: jax.Array, widths: tuple[int, ...], fn: Callable, *operands):
  """Runs `fn(width, *operands)` at this device's bucket width (see module doc).

  Args:
    active: int32 scalar, units this device computes.
    widths: static ascending bucket widths.
    fn: fn(width, *operands) -> outputs; all widths must give outputs of the same shape.
  """
  return at_bucket(bucket_index(active, widths), widths, fn, *operands)


MLP_UNITS = ((1, 1), (0, 1), (0, 1))   # (unit axis, unit size) of w1, b1, w2


def attention_units(head_dim: int) -> tuple:
  """(unit axis, unit size) of wq, bq, wk, bk, wv, bv, wo: one unit is one head."""
  col, bias, row = (1, head_dim), (0, head_dim), (0, head_dim)
  return (col, bias, col, bias, col, bias, row)


def unit_mask(width: int, active: jax.Array, dtype) -> jax.Array:
  """[width] 1.0 on the first `active` slots, 0.0 after."""
  return (jnp.arange(width) < active).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Cut:
  """What a resized device leaves out of one block (built inside shard_map, local values).

  units mode (feats is None): the block computes only slots `units[:kept]` (both GEMMs shrink).
  contraction mode: the column GEMMs contract over input features `feats[:feats_kept]` only and
  the row GEMM over slots `units[:kept]` only; output shapes are unchanged.

  Attributes:
    units: int32 [C] a permutation of the local slots, kept ones first.
    kept: int32 scalar, how many of `units` are computed.
    feats: int32 [D] a permutation of the d_model input features, kept first, or None (units
      mode).
    feats_kept: int32 scalar.
    col_scale, row_scale: scalars multiplying the column / row GEMM results (1.0, or full/kept
      for the `rescale` imputation).
    row_width, feat_width: static compute widths of the row GEMM's slots and of the features
      (contraction mode).
  """

  units: jax.Array
  kept: jax.Array
  feats: jax.Array | None = None
  feats_kept: jax.Array | None = None
  col_scale: jax.Array | float = 1.0
  row_scale: jax.Array | float = 1.0
  row_width: int = 0
  feat_width: int = 0


def _entries(idx, unit_size):
  """Unit indices [k] -> entry indices [k*unit_size] along an axis with unit_size per unit."""
  if unit_size == 1:
    return idx
  return (idx[:, None] * unit_size + jnp.arange(unit_size)).reshape(-1)


def permuted_take(a, perm, k, axis, unit_size=1):
  """a's units `perm[:k]` along `axis`; `perm` is a permutation of all units on that axis.

  The same values as `jnp.take`, but the gradient is *gathered* back through the inverse
  permutation instead of scattered (a scatter is slow on CPUs, and the activations of the
  contraction mode go through here).
  """
  # Inside shard_map `a` may be replicated where `perm` varies over devices: adding a zero that
  # varies like `perm` makes it varying first, so autodiff (not the custom rule) sums its gradient.
  a = a + (perm[0] * 0).astype(a.dtype)
  return _permuted_take(a, perm, k, axis, unit_size)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _permuted_take(a, perm, k, axis, unit_size):
  return jnp.take(a, _entries(perm[:k], unit_size), axis=axis)


def _permuted_fwd(a, perm, k, axis, unit_size):
  return _permuted_take(a, perm, k, axis, unit_size), perm


def _permuted_bwd(k, axis, unit_size, perm, g):
  pad = [(0, 0)] * g.ndim
  pad[axis] = (0, perm.shape[0] * unit_size - g.shape[axis])
  inv = _entries(jnp.argsort(perm), unit_size)
  return jnp.take(jnp.pad(g, pad), inv, axis=axis), None


_permuted_take.defvjp(_permuted_fwd, _permuted_bwd)


def _column(x, w, b, width, unit_size, cut):
  """Column-parallel GEMM of x [..., d_model] with the local block w [d_model, C*unit_size].

  Returns [..., width*unit_size]: the first `width` slots, or the slots `cut.units[:width]` in
  units mode; in contraction mode only the features `cut.feats[:cut.feats_kept]` are summed.
  """
  n = width * unit_size
  if cut is None:
    return x @ w[:, :n] + b[:n]
  if cut.feats is None:
    take = lambda a, axis: permuted_take(a, cut.units, width, axis, unit_size)
    return x @ take(w, 1) + take(b, 0)
  fw = cut.feat_width
  xf = permuted_take(x, cut.feats, fw, x.ndim - 1) * unit_mask(fw, cut.feats_kept, x.dtype)
  return (xf @ permuted_take(w[:, :n], cut.feats, fw, 0)) * cut.col_scale + b[:n]


def _row(h, w, width, unit_size, cut):
  """Row-parallel GEMM of h [..., width, unit_size] (masked) with w [C*unit_size, d_model].

  Returns this device's partial sum [..., d_model], times `cut.row_scale`. In contraction mode
  it sums only over the slots `cut.units[:cut.kept]`.
  """
  flat = lambda a: a.reshape(*a.shape[:-2], a.shape[-2] * unit_size)
  if cut is None:
    return flat(h) @ w[:width * unit_size]
  if cut.feats is None:   # units mode: h already holds the selected units
    return (flat(h) @ permuted_take(w, cut.units, width, 0, unit_size)) * cut.row_scale
  rw, capacity = cut.row_width, cut.units.shape[0]
  pad = [(0, 0)] * h.ndim
  pad[-2] = (0, capacity - width)
  hk = permuted_take(jnp.pad(h, pad), cut.units, rw, h.ndim - 2)
  hk = hk * unit_mask(rw, cut.kept, h.dtype)[:, None]
  return (flat(hk) @ permuted_take(w, cut.units, rw, 0, unit_size)) * cut.row_scale


def _computed(width, active, cut):
  """int32 scalar: how many leading computed slots are real (the rest are masked to zero)."""
  return active if cut is None or cut.feats is not None else cut.kept


def mlp_partial(width, x, w1, b1, w2, active, cut: Cut | None = None):
  """This device's partial MLP output, computed at `width` units.

  Args:
    width: static compute width (<= C).
    x: [..., d_model] activations (replicated over `tensor`).
    w1: [d_model, C] local column block; b1: [C]; w2: [C, d_model] local row block.
    active: int32 scalar; slots >= active contribute zero.
    cut: what a resized device leaves out (`Cut`), or None for the exact block.

  Returns:
    [..., d_model] partial sum (before the all-reduce, without the output bias).
  """
  h = jax.nn.gelu(_column(x, w1, b1, width, 1, cut))
  h = h * unit_mask(width, _computed(width, active, cut), h.dtype)
  return _row(h[..., None], w2, width, 1, cut)


def attention_partial(width, x, wq, bq, wk, bk, wv, bv, wo, active, cut: Cut | None = None, *,
                      head_dim, causal):
  """This device's partial attention output, computed at `width` heads.

  Args:
    width: static compute width in heads (<= C).
    x: [batch, seq, d_model] activations (replicated over `tensor`).
    wq, wk, wv: [d_model, C*head_dim] local column blocks; bq, bk, bv: [C*head_dim];
    wo: [C*head_dim, d_model] local row block.
    active: int32 scalar; heads >= active contribute zero.
    cut: what a resized device leaves out (`Cut`), or None for the exact block.
    head_dim: features per head. causal: mask future positions.

  Returns:
    [batch, seq, d_model] partial sum (before the all-reduce, without the output bias).
  """
  heads = lambda w, b: _column(x, w, b, width, head_dim, cut).reshape(
      *x.shape[:-1], width, head_dim)
  q, k, v = heads(wq, bq), heads(wk, bk), heads(wv, bv)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q / math.sqrt(head_dim), k)
  if causal:
    seq = x.shape[-2]
    keep = jnp.tril(jnp.ones((seq, seq), bool))
    logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  out = out * unit_mask(width, _computed(width, active, cut), out.dtype)[:, None]
  return _row(out, wo, width, head_dim, cut)


def _resized(plan: Plan, kind: str, fn: Callable, x, weights, active):
  """(partial output, executed width) of one device under a `resize.Resize` plan.

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
    cut_index = bucket_index(active, widths) * len(r.fractions) + frac
  else:
    feats = feats_kept = jnp.zeros((), jnp.int32)
    resized = kept < active
    cuts = tuple((w, 1.0) for w in widths)
    cut_index = bucket_index(kept, widths)
  scale = lambda full, part: jnp.where(part > 0, full / jnp.maximum(part, 1), 1.0).astype(
      x.dtype) if r.rescale else 1.0

  def run(variant, x, *args):
    *weights, order, kept, feats, feats_kept = args
    exact, width, f = variant
    if exact:
      return fn(width, x, *weights, active)
    if not contraction:
      return fn(width, x, *weights, active, Cut(order, kept, row_scale=scale(active, kept)))
    cut = Cut(order, kept, feats, feats_kept, col_scale=scale(d_model, feats_kept),
              row_scale=scale(active, kept), row_width=math.ceil(f * width),
              feat_width=math.ceil(f * d_model))
    return fn(width, x, *weights, active, cut)

  variants = tuple((True, w, 1.0) for w in widths) + tuple((False, w, f) for w, f in cuts)
  index = jnp.where(resized, len(widths) + cut_index, bucket_index(active, widths))
  y = at_bucket(index, variants, run, x, *weights, order, kept, feats, feats_kept)
  executed = jnp.asarray([w * f for _, w, f in variants], jnp.float32)[index]
  return y, executed


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
  it helps with at the offload chunk width; the emulated sleep charges both.

  Returns:
    The full block output, replicated over `tensor`.
  """
  active = plan.active[kind][0]
  widths = plan.widths_of(kind)
  # Make the replicated x varying over `tensor` (adding a zero that varies like `active`) once,
  # outside the per-device branches: then the all-reduce of its gradient is not inside every
  # branch, where a branch without one would leave the other devices waiting.
  x = x + (active * 0).astype(x.dtype)
  if plan.offload is not None:
    if units is None or len(units) != len(weights):
      raise ValueError(f"tp.row_parallel.units: offload needs (axis, unit size) for each of the "
                       f"{len(weights)} weights of {kind}, got {units!r}")
    from semijax import offload as offload_lib   # lazy: offload imports tp
    y, executed = offload_lib.block_partial(plan.offload[kind], widths, fn, x, weights, units)
  elif plan.resize is None:
    y = at_width(active, widths, fn, x, *weights, active)
    executed = jnp.asarray(widths, jnp.float32)[bucket_index(active, widths)]
  else:
    y, executed = _resized(plan, kind, fn, x, weights, active)
  if plan.slowdown is not None:
    # The delay depends on y (times zero), so the sleep runs after this block's compute: a delay
    # of plan data only lets XLA run the sleeps of several blocks at once (seen with offload).
    after = jax.lax.stop_gradient(y[(0,) * y.ndim] * 0).astype(jnp.float32)
    y = hetero.straggle(y, plan.unit_ms_of(kind) * executed * plan.slowdown[0] + after)
  return jax.lax.psum(y, mesh_lib.TENSOR)
