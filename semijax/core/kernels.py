"""Per-device compute kernels of uneven tensor parallelism, at bucketed widths.

Everything here runs *inside* `jax.shard_map` on local blocks. A column-parallel GEMM followed by a
row-parallel GEMM (Megatron) produces, on every tensor device, a partial sum of the full output;
one `psum` over the `tensor` axis (in `tp.row_parallel`) completes it.

Uneven work: device d computes only its first `active[d]` unit slots. Masking alone would still
run GEMMs at the capacity C, so each block is compiled at a few bucket widths and `lax.switch`
picks, per device and at run time, the smallest width >= active[d] (`at_width`). The branch index
is data, so changing counts or actives inside a capacity bucket never recompiles.

What a branch keeps for the backward pass decides what the branched step costs (`BRANCH_MODES`,
measured by experiments/bench_widths.py). `lax.switch` under autodiff keeps the residuals of
*every* branch, zero-filled for the branches not taken, and merges only residuals of the same
shape and dtype across branches. So each branch is checkpointed (`jax.checkpoint`) with a policy
that saves only its GEMM outputs (`SAVED`: the column GEMMs' results, and attention's output
before the row GEMM), each padded to the capacity C: every branch then saves the same shapes, the
switch keeps one set of residuals, and the backward pass recomputes only elementwise work and
the attention scores, not the GEMMs. (Rematerializing the whole branch instead, the "remat"
mode, reruns every forward GEMM in the backward pass; keeping plain residuals, "residuals",
zero-fills every branch's own.)

The other kernel (`layout.kernel`="pallas", `core.width_gemm`) has no branches: given width None,
`mlp_partial` and `attention_partial` run the block at the capacity C with GEMMs that skip the
tiles past `active` (the limit is data, so one program serves every width and no conditional
reads an index back to the host). The attention scores and softmax still run over all C heads
(the heads past `active` are zeros, masked before the row GEMM), but for a device with no
active head under a plan that may leave one without (`skip_idle`), which skips them in a cond.

`Cut` describes what a ZERO-resized device leaves out of a block (`core.resize`); `mlp_partial`
and `attention_partial` compute one device's partial block output, exact or cut.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable, Iterator

import jax
import jax.numpy as jnp
from jax import ad_checkpoint

from semijax.core import mesh as mesh_lib
from semijax.core import width_gemm

# What a branch keeps for the backward pass (see module doc): "saved" (the padded GEMM outputs,
# named `SAVED`), "remat" (nothing: the whole forward pass reruns) or "residuals" (everything
# autodiff keeps, per branch). Benchmarks compare them with `branching`.
BRANCH_MODES = ("saved", "remat", "residuals")
SAVED = "semijax_branch_saved"
_branch_mode = "saved"
_saving = False       # tracing the branches of a switch in "saved" mode (see `saved`)


@contextlib.contextmanager
def branching(mode: str) -> Iterator[None]:
  """Traces the branched blocks inside the `with` in branch mode `mode` (`BRANCH_MODES`), for
  benchmarks; a function traced earlier keeps the mode it was traced with."""
  global _branch_mode
  if mode not in BRANCH_MODES:
    raise ValueError(f"branch mode: {mode!r} is not one of {BRANCH_MODES}")
  old, _branch_mode = _branch_mode, mode
  try:
    yield
  finally:
    _branch_mode = old


def bucket_index(active: jax.Array, widths: tuple[int, ...]) -> jax.Array:
  """Index of the smallest width >= active (int32 scalar); widths are ascending."""
  return jnp.sum(active > jnp.asarray(widths[:-1], active.dtype)).astype(jnp.int32)


def at_bucket(index: jax.Array, variants: tuple, fn: Callable, *operands):
  """Runs `fn(variants[index], *operands)`: static variants, a traced index (see module doc)."""
  if len(variants) == 1:
    return fn(variants[0], *operands)
  global _saving
  branches = [functools.partial(fn, v) for v in variants]
  if _branch_mode == "saved":
    policy = jax.checkpoint_policies.save_only_these_names(SAVED)
    branches = [jax.checkpoint(b, policy=policy) for b in branches]
  elif _branch_mode == "remat":
    branches = [jax.checkpoint(b) for b in branches]
  before, _saving = _saving, _branch_mode == "saved"
  try:                                   # lax.switch traces the branches here
    return jax.lax.switch(index, branches, *operands)
  finally:
    _saving = before


def saved(a: jax.Array, capacity: int) -> jax.Array:
  """`a` [..., n], a GEMM output a branch keeps for its backward pass: padded to [..., capacity]
  with zeros and named `SAVED` (so that every branch keeps the same shape), then cut back to n.
  The identity outside the branches of a switch in "saved" mode (a single-width step keeps its
  residuals as autodiff does)."""
  if not _saving:
    return a
  n = a.shape[-1]
  if n >= capacity:
    return ad_checkpoint.checkpoint_name(a, SAVED)
  pad = [(0, 0)] * (a.ndim - 1) + [(0, capacity - n)]
  return ad_checkpoint.checkpoint_name(jnp.pad(a, pad), SAVED)[..., :n]


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


def column(x, w, b, width, unit_size, cut, limit=None):
  """Column-parallel GEMM of x [..., d_model] with the local block w [d_model, C*unit_size] and
  bias b [C*unit_size] (None: no bias).

  Returns [..., width*unit_size]: the first `width` slots, or the slots `cut.units[:width]` in
  units mode; in contraction mode only the features `cut.feats[:cut.feats_kept]` are summed.
  With `limit` (int32 scalar, the pallas kernel; width = C), the slots >= limit are skipped
  (their GEMM outputs are zero, plus the bias).
  """
  n = width * unit_size
  bias = lambda y, b: y if b is None else y + b
  if limit is not None:
    return bias(width_gemm.column(x, w, limit * unit_size), b)
  if cut is None:
    return saved(bias(x @ w[:, :n], None if b is None else b[:n]), w.shape[1])
  if cut.feats is None:
    take = lambda a, axis: permuted_take(a, cut.units, width, axis, unit_size)
    return bias(x @ take(w, 1), None if b is None else take(b, 0))
  fw = cut.feat_width
  xf = permuted_take(x, cut.feats, fw, x.ndim - 1) * unit_mask(fw, cut.feats_kept, x.dtype)
  return bias((xf @ permuted_take(w[:, :n], cut.feats, fw, 0)) * cut.col_scale,
              None if b is None else b[:n])


def row(h, w, width, unit_size, cut, limit=None):
  """Row-parallel GEMM of h [..., width, unit_size] (masked) with w [C*unit_size, d_model].

  Returns this device's partial sum [..., d_model], times `cut.row_scale`. In contraction mode
  it sums only over the slots `cut.units[:cut.kept]`; with `limit` (the pallas kernel) only over
  the slots < limit.
  """
  flat = lambda a: a.reshape(*a.shape[:-2], a.shape[-2] * unit_size)
  if limit is not None:
    return width_gemm.row(flat(h), w, limit * unit_size)
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


def computed(width, active, cut):
  """int32 scalar: how many leading computed slots are real (the rest are masked to zero)."""
  return active if cut is None or cut.feats is not None else cut.kept


def kernel_width(width, active, cut, capacity):
  """(limit, width): width None is the pallas kernel, (active, capacity); else (None, width)."""
  if width is not None:
    return None, width
  if cut is not None:
    raise ValueError("kernels: the pallas kernel (width None) computes exact blocks only, "
                     "not a resized device's cut")
  return active, capacity


def mlp_partial(width, x, w1, b1, w2, active, cut: Cut | None = None):
  """This device's partial MLP output, computed at `width` units.

  Args:
    width: static compute width (<= C), or None: C, through the pallas kernels that skip the
      units >= active (`core.width_gemm`; no `cut`).
    x: [..., d_model] activations (replicated over `tensor`).
    w1: [d_model, C] local column block; b1: [C]; w2: [C, d_model] local row block.
    active: int32 scalar; slots >= active contribute zero.
    cut: what a resized device leaves out (`Cut`), or None for the exact block.

  Returns:
    [..., d_model] partial sum (before the all-reduce, without the output bias).
  """
  limit, width = kernel_width(width, active, cut, w1.shape[1])
  h = jax.nn.gelu(column(x, w1, b1, width, 1, cut, limit))
  h = h * unit_mask(width, computed(width, active, cut), h.dtype)
  return row(h[..., None], w2, width, 1, cut, limit)


def attention_core(q, k, v, active, *, causal: bool, implementation: str, skip: bool):
  """softmax(q k^T / sqrt(head_dim)) v over this device's heads: q [batch, seq, heads,
  head_dim], k and v [batch, seq, kv_heads, head_dim] (kv_heads divides heads; query head
  h attends with key head h // (heads / kv_heads)) -> [batch, seq, heads, head_dim]. No heads
  (a width 0) computes nothing; `skip`: a device without an active head (`active` 0) skips the
  scores and softmax in a cond (`mesh.cond_or_zeros`; zeros out)."""
  if q.shape[-2] == 0:  # a drained device: no heads, a zero partial sum from the empty row GEMM
    return q
  attend = functools.partial(jax.nn.dot_product_attention, is_causal=causal,
                             implementation=implementation)
  return mesh_lib.cond_or_zeros(active > 0, attend, q, k, v) if skip else attend(q, k, v)


def attention_partial(width, x, wq, bq, wk, bk, wv, bv, wo, active, cut: Cut | None = None, *,
                      head_dim, causal, implementation="xla", skip_idle=False):
  """This device's partial attention output, computed at `width` heads.

  Args:
    width: static compute width in heads (<= C; 0 computes nothing), or None: C, through the
      pallas kernels that skip the heads >= active in the projections (`core.width_gemm`; no
      `cut`).
    x: [batch, seq, d_model] activations (replicated over `tensor`).
    wq, wk, wv: [d_model, C*head_dim] local column blocks; bq, bk, bv: [C*head_dim];
    wo: [C*head_dim, d_model] local row block.
    active: int32 scalar; heads >= active contribute zero.
    cut: what a resized device leaves out (`Cut`), or None for the exact block.
    head_dim: features per head. causal: mask future positions.
    implementation: of `jax.nn.dot_product_attention`, "xla" or "cudnn" (the softmax is float32
      in both).
    skip_idle: with width None, a device with no active head skips the scores and the softmax
      over its C zero heads (a `lax.cond`, `mesh.cond_or_zeros`): set under a plan in which a
      device may own no head (`Plan.idle`); a bucketed width 0 skips them anyway.

  Returns:
    [batch, seq, d_model] partial sum (before the all-reduce, without the output bias).
  """
  pallas = width is None
  limit, width = kernel_width(width, active, cut, wo.shape[0] // head_dim)
  heads = lambda w, b: column(x, w, b, width, head_dim, cut, limit).reshape(
      *x.shape[:-1], width, head_dim)
  q, k, v = heads(wq, bq), heads(wk, bk), heads(wv, bv)
  out = attention_core(q, k, v, active, causal=causal, implementation=implementation,
                       skip=pallas and skip_idle)
  if cut is None:     # the row GEMM's input, kept by a branch (see `saved`)
    flat = saved(out.reshape(*out.shape[:-2], width * head_dim), wo.shape[0])
    out = flat.reshape(out.shape)
  out = out * unit_mask(width, computed(width, active, cut), out.dtype)[:, None]
  return row(out, wo, width, head_dim, cut, limit)
