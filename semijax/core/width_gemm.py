"""GEMMs that skip the work past a run-time width: Pallas kernels, one program, no conditional.

An uneven split's device computes only its first `active` units of a block whose arrays hold C
(its capacity). The `switch` kernel (`kernels.at_width`) compiles the block at a few bucket
widths and picks one with `lax.switch`; XLA:GPU runs such a conditional by reading the branch
index back to the host, and every device pays for it (10-18% of a block on an H200). The
`pallas` kernel runs the block at capacity with GEMMs that take the active width as data: a tile
of the product that lies wholly past it is not computed (its output is written as zeros), a tile
that straddles it is masked, and the contraction stops at it. One program serves every width.

`matmul(a, b, limit, dim)` is the primitive: the product of a [M, K] and b [K, N] with the
entries past `limit` along `dim` left out: rows ("m") or columns ("n") of the output zero, or
the contraction ("k") summed over its first `limit` entries only. `column` and `row` are the two
GEMMs of a column->row parallel block, each a `jax.custom_vjp` whose backward pass is built from
the same kernel (so a narrow device's backward pass is narrow too):

  column  y = x @ w, columns >= limit zero    dx = dy @ w.T (k)   dw = x.T @ dy (n)
  row     y = h[:, :limit] @ w[:limit]        dh = dy @ w.T (n)   dw = h.T @ dy (m)

On GPUs the kernel lowers to Triton, on TPUs to Mosaic (the limit in SMEM), and elsewhere it
runs in Pallas's TPU interpreter (the CPU tests; hundreds of times slower than XLA, so `resolve`
keeps `switch` there). A program holds a tile's whole strips of the contraction: on a TPU they
sit in VMEM, so a very long contraction (a weight gradient sums over every token of the local
batch) can outgrow it; the TPU path is lowered in the tests but has not run on a TPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

# `layout.kernel`: how a device computes its width of a block. "switch": `lax.switch` over the
# compiled bucket widths; "pallas": this module's kernels; "auto": pallas on GPU and TPU, switch
# elsewhere (see `resolve`).
KERNELS = ("switch", "pallas", "auto")
DIMS = ("m", "n", "k")
# (bm, bn, bk) tiles by platform and operand bytes (the common Triton and Mosaic choices; a
# dimension smaller than its tile gets a smaller one, `_tile`), and Triton's launch parameters.
_TILES = {("gpu", 2): (128, 128, 64), ("gpu", 4): (128, 128, 32),
          ("tpu", 2): (128, 128, 256), ("tpu", 4): (128, 128, 128)}
_WARPS, _STAGES = 8, 3


def resolve(kernel: str, backend: str | None = None) -> str:
  """"switch" or "pallas": `kernel` ("auto" is pallas on the gpu and tpu backends); `backend`
  defaults to jax.default_backend()."""
  if kernel not in KERNELS:
    raise ValueError(f"layout.kernel: {kernel!r} is not one of {KERNELS}")
  if kernel != "auto":
    return kernel
  return "pallas" if (backend or jax.default_backend()) in ("gpu", "tpu") else "switch"


def _platform() -> str:
  """"gpu", "tpu" or "interpret" (any other backend): how `matmul` runs its kernel."""
  backend = jax.default_backend()
  return backend if backend in ("gpu", "tpu") else "interpret"


def _tile(n: int, preferred: int) -> int:
  """The tile along a dimension of size n: `preferred`, or the power of two >= n (at least 16)
  when n is smaller; the caller pads n to a multiple of it."""
  return preferred if n >= preferred else max(16, pl.next_power_of_2(n))


def _kernel(limit_ref, a_ref, b_ref, o_ref, *, dim, trans_a, trans_b, tiles, k_size):
  """One [bm, bn] tile of the limited product (see `matmul`); a_ref and b_ref hold the tile's
  full strips of the contraction ([bm, K] / [K, bn], or transposed)."""
  bm, bn, bk = tiles
  limit = limit_ref[0]
  i, j = pl.program_id(0), pl.program_id(1)
  start = {"m": i * bm, "n": j * bn, "k": 0}[dim]

  def strip(ref, t, transposed, rows):
    """The t-th [*, bk] (rows=False) or [bk, *] (rows=True) slice of a strip."""
    k = pl.ds(pl.multiple_of(t * bk, bk), bk)
    return ref[k, :] if rows != transposed else ref[:, k]

  def tile_product(t, acc, masked):
    a, b = strip(a_ref, t, trans_a, False), strip(b_ref, t, trans_b, True)
    if masked:   # the contraction's last tile straddles the limit: zero a's entries past it
      axis = 0 if trans_a else 1
      shape = (bk, 1) if trans_a else (1, bk)
      idx = t * bk + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
      a = jnp.where(idx < limit, a, jnp.zeros_like(a))
    dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
    return acc + jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)

  @pl.when(start < limit)
  def _compute():
    k_tiles = k_size // bk
    # limit >= 0: lax.div truncates (no sign handling for Mosaic to lower)
    full = jnp.minimum(jax.lax.div(limit, bk), k_tiles) if dim == "k" else k_tiles
    acc = jax.lax.fori_loop(0, full, lambda t, acc: tile_product(t, acc, False),
                            jnp.zeros((bm, bn), jnp.float32))
    if dim == "k":   # at most one tile straddles the limit
      acc = jax.lax.fori_loop(full, jnp.minimum(jax.lax.div(limit + bk - 1, bk), k_tiles),
                              lambda t, acc: tile_product(t, acc, True), acc)
    elif dim == "n":
      idx = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
      acc = jnp.where(idx < limit, acc, 0.0)
    else:
      idx = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
      acc = jnp.where(idx < limit, acc, 0.0)
    o_ref[...] = acc.astype(o_ref.dtype)

  @pl.when(start >= limit)
  def _skip():
    o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)


def _compiler_params(platform: str):
  if platform == "gpu":
    return plgpu.CompilerParams(num_warps=_WARPS, num_stages=_STAGES)
  if platform == "tpu":
    return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"))
  return None


def _interpret(platform: str):
  """Pallas's TPU interpreter off accelerators (unlike the generic one it runs kernels whose
  operands vary over shard_map's manual axes)."""
  if platform != "interpret":
    return False
  return pltpu.InterpretParams()


def _limit_spec(platform: str) -> pl.BlockSpec:
  """The limit's block: a scalar in SMEM on TPUs (and in their interpreter), else one entry."""
  if platform in ("tpu", "interpret"):
    return pl.BlockSpec(memory_space=pltpu.SMEM)
  return pl.BlockSpec((1,), lambda i, j: (0,))


def _varying_alike(*xs):
  """xs cast to vary over the union of their manual mesh axes, and that type (the output type a
  `pallas_call` inside `shard_map` must declare); outside shard_map nothing varies."""
  mats = [getattr(jax.typeof(x), "mat", None) for x in xs]
  if any(m is None for m in mats):       # a JAX without manual axis types: nothing to declare
    return xs, None
  union = frozenset().union(*(m.varying for m in mats))
  xs = tuple(jax.lax.pcast(x, tuple(sorted(union - m.varying)), to="varying")
             if union - m.varying else x for x, m in zip(xs, mats))
  return xs, jax.typeof(xs[0]).mat


def matmul(a: jax.Array, b: jax.Array, limit: jax.Array, dim: str, *, trans_a: bool = False,
           trans_b: bool = False, platform: str | None = None,
           tiles: tuple[int, int, int] | None = None) -> jax.Array:
  """The product of a and b with the entries past `limit` along `dim` left out.

  Args:
    a: [M, K], or [K, M] when trans_a. b: [K, N], or [N, K] when trans_b. Same dtype.
    limit: int32 scalar (data: one compiled program for every value), clipped to [0, size].
    dim: "m" (output rows >= limit are zero), "n" (output columns >= limit are zero) or "k"
      (only the first `limit` entries of the contraction are summed).
    platform: "gpu" (Triton), "tpu" (Mosaic) or "interpret"; default from the backend.
    tiles: (bm, bn, bk), the tile sizes to prefer (default: by platform and dtype).

  Returns:
    [M, N] in a's dtype, accumulated in float32.
  """
  if dim not in DIMS:
    raise ValueError(f"width_gemm.matmul.dim: {dim!r} is not one of {DIMS}")
  platform = platform or _platform()
  (m, k) = a.shape[::-1] if trans_a else a.shape
  (k2, n) = b.shape[::-1] if trans_b else b.shape
  if k != k2:
    raise ValueError(f"width_gemm.matmul: contraction sizes differ, a {a.shape} "
                     f"(trans_a={trans_a}) and b {b.shape} (trans_b={trans_b})")
  prefer = tiles or _TILES["tpu" if platform == "tpu" else "gpu",
                          2 if a.dtype.itemsize <= 2 else 4]
  tiles = tuple(_tile(s, p) for s, p in zip((m, n, k), prefer))
  bm, bn, bk = tiles
  pm, pn, pk = (-m % bm, -n % bn, -k % bk)
  if pm or pn or pk:            # pad to whole tiles (zeros add nothing to the product)
    a = jnp.pad(a, ((0, pk), (0, pm)) if trans_a else ((0, pm), (0, pk)))
    b = jnp.pad(b, ((0, pn), (0, pk)) if trans_b else ((0, pk), (0, pn)))
  size = {"m": m, "n": n, "k": k}[dim]
  limit = jnp.clip(jnp.asarray(limit, jnp.int32), 0, size).reshape(1)
  (limit, a, b), manual = _varying_alike(limit, a, b)
  out_shape = (jax.ShapeDtypeStruct((m + pm, n + pn), a.dtype) if manual is None else
               jax.ShapeDtypeStruct((m + pm, n + pn), a.dtype, manual_axis_type=manual))
  full_k = k + pk
  a_spec = (pl.BlockSpec((full_k, bm), lambda i, j: (0, i)) if trans_a
            else pl.BlockSpec((bm, full_k), lambda i, j: (i, 0)))
  b_spec = (pl.BlockSpec((bn, full_k), lambda i, j: (j, 0)) if trans_b
            else pl.BlockSpec((full_k, bn), lambda i, j: (0, j)))
  out = pl.pallas_call(
      functools.partial(_kernel, dim=dim, trans_a=trans_a, trans_b=trans_b, tiles=tiles,
                        k_size=full_k),
      out_shape=out_shape,
      grid=((m + pm) // bm, (n + pn) // bn),
      in_specs=[_limit_spec(platform), a_spec, b_spec],
      out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
      interpret=_interpret(platform),
      compiler_params=_compiler_params(platform),
      name=f"width_gemm_{dim}")(limit, a, b)
  return out[:m, :n] if pm or pn else out


def _flat(a: jax.Array) -> jax.Array:
  return a.reshape(-1, a.shape[-1])


def _like(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
  """A cotangent summed over the manual mesh axes along which it varies and its primal does not
  (a weight's gradient over `data`): what autodiff's transpose of the implicit cast does."""
  mats = [getattr(jax.typeof(x), "mat", None) for x in (cotangent, primal)]
  if any(m is None for m in mats) or not (extra := mats[0].varying - mats[1].varying):
    return cotangent
  return jax.lax.psum(cotangent, tuple(sorted(extra)))


def _limited_gemm(dim: str, dx_dim: str, dw_dim: str):
  """The GEMM y = x @ w limited along `dim` (`matmul`), as a custom_vjp whose backward GEMMs,
  dx = dy @ w.T and dw = x.T @ dy, are limited along `dx_dim` and `dw_dim`."""
  @jax.custom_vjp
  def gemm(x, w, limit):
    return matmul(_flat(x), w, limit, dim).reshape(*x.shape[:-1], w.shape[1])

  def forward(x, w, limit):
    return gemm(x, w, limit), (x, w, limit)

  def backward(residuals, dy):
    x, w, limit = residuals
    dx = matmul(_flat(dy), w, limit, dx_dim, trans_b=True).reshape(x.shape)
    dw = matmul(_flat(x), _flat(dy), limit, dw_dim, trans_a=True)
    return _like(dx, x), _like(dw, w), None

  gemm.defvjp(forward, backward)
  return gemm


_column = _limited_gemm("n", "k", "n")
_row = _limited_gemm("k", "n", "m")


def column(x: jax.Array, w: jax.Array, limit: jax.Array) -> jax.Array:
  """Column-parallel GEMM: x [..., D] @ w [D, N] -> [..., N], columns >= limit zero."""
  return _column(x, w, limit)


def row(h: jax.Array, w: jax.Array, limit: jax.Array) -> jax.Array:
  """Row-parallel GEMM: h [..., N] @ w [N, D] -> [..., D], summed over h's first `limit`
  entries only (a device's partial sum)."""
  return _row(h, w, limit)
