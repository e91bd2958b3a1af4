"""Offload, the authors' variant of migration (a baseline): helpers compute a straggler's units.

The straggler keeps ownership of its units (weights, gradients, optimizer moments). In every
step it sends the weights of some of its units (and, for a row-parallel GEMM alone, its input
shard for them) to helper devices with `ppermute`; each helper computes those units and its
partial result is reduced back: into the all-reduce of a row-parallel GEMM, or with a reverse
`ppermute` into the straggler's output shard for a column-parallel GEMM. The backward pass is
JAX autodiff: the transpose of a ppermute is the reverse ppermute, so the weight gradients of the
offloaded units land on the straggler, exactly.

Everything here runs *inside* `jax.shard_map` on local blocks (axis `mesh.TENSOR`), like `tp`:
  * `column_parallel`, `row_parallel_gemm`: one GEMM each (exact for both kinds of GEMM);
  * `row_parallel`: a fused column->row block (`kernels.mlp_partial`,
    `kernels.attention_partial`) with the same contract as `tp.row_parallel`; the helpers
    compute the offloaded units' whole column->row path from the replicated block input, so
    only weights travel. `mlp_block` and `attention_block` name the unit axes of each weight.
  * `block_partial`: the same before the all-reduce, with the width this device executed;
    `tp.row_parallel` runs it when `plan_lib.Plan.offload` is set (so training can offload), charges
    the emulated straggler sleep for that width, then all-reduces.

Compile once: `rounds` and `chunk` are static, the amounts (`keep`, `send`, `count`) are data.
`static_shape(layout)` fixes the statics independently of the amounts (N-1 shift rounds that
cover every pair, chunk = capacity // 2), so one compiled step serves every offload of a bucket.
Host helpers: `for_target` (the offload that reaches target counts) and `step_bytes` (bytes per
step, for a cost model).

What the straggler still computes: its leading `keep` slots; the offloaded slots are those after
`keep`. `row_parallel` runs them at the compiled bucket width >= keep (`kernels.at_width`), so
offload shrinks the straggler's GEMMs; the single-GEMM functions compute at capacity and mask
(they are the exactness reference for both GEMM kinds, not the fast path).

Cost per offloaded block and step (vs migration, which moves the units once): the weights of the
offloaded units go out in the forward pass and their gradients come back in the backward pass
(2 x weight bytes), and the helpers compute the units at chunk width K.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from semijax.core import kernels
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib

TENSOR = mesh_lib.TENSOR


@functools.partial(jax.tree_util.register_dataclass, data_fields=("keep", "send", "count"),
                   meta_fields=("rounds", "chunk"))
@dataclasses.dataclass(frozen=True)
class OffloadPlan:
  """Who computes which units of one kind (global arrays split over `tensor`; [1, ...] locally).

  Attributes:
    keep: int32 [N]: leading slots each device computes itself (its active count minus what it
      offloads).
    send: int32 [N, R, K]: local slots device d sends in round r; C (capacity) = nothing.
    count: int32 [N, R]: units device d receives and computes in round r (0 = none).
    rounds: static; one ppermute permutation ((src, dst), ...) per round (each device at most
      once as source and once as destination).
    chunk: static K, the slots one round carries per pair.
  """

  keep: jax.Array
  send: jax.Array
  count: jax.Array
  rounds: tuple
  chunk: int

  def specs(self) -> "OffloadPlan":
    """shard_map in_specs: every data leaf split over `tensor`."""
    return jax.tree.map(lambda _: P(TENSOR), self)


def static_shape(layout: layout_lib.UnitLayout) -> tuple[tuple, int]:
  """(rounds, chunk) that do not depend on the offload amounts, for one unit kind.

  rounds: N-1 shift permutations, round r sends d -> (d + r + 1) mod N, so every
  (straggler, helper) pair has exactly one round. chunk: max(1, capacity // 2) units per pair.
  Plans built with these statics (`make_plan(..., rounds=, chunk=)`) share one tree structure
  and shapes for every offload amount, so one compiled step serves them all.
  """
  n = layout.num_devices
  rounds = tuple(tuple((d, (d + r + 1) % n) for d in range(n)) for r in range(n - 1))
  return rounds, max(1, layout.capacity // 2)


def _pairs(f: str, layout: layout_lib.UnitLayout, offloads: dict):
  """(keep [N], [(src, dst, local slots)]) of an offload description (validated)."""
  n = layout.num_devices
  keep = np.asarray(layout.active, np.int32).copy()
  pairs = []
  for s, helpers in offloads.items():
    if not 0 <= s < n:
      raise layout_lib.LayoutError(f"{f}: straggler {s} is not a device in [0, {n})")
    total = sum(helpers.values())
    if any(c < 0 for c in helpers.values()) or total > layout.active[s]:
      raise layout_lib.LayoutError(
          f"{f}: device {s} offloads {dict(helpers)} units but computes {layout.active[s]}")
    start = layout.active[s] - total
    keep[s] = start
    for h, c in helpers.items():
      if not 0 <= h < n or h == s:
        raise layout_lib.LayoutError(f"{f}: helper {h} of device {s} is not another device")
      if c:
        pairs.append((s, h, list(range(start, start + c))))
        start += c
  return keep, pairs


def _greedy_rounds(pairs):
  """Pairs grouped into rounds in which no device is twice a source or twice a destination."""
  rounds = []
  for s, h, slots in pairs:
    for r in rounds:
      if all(s != a and h != b for a, b, _ in r):
        r.append((s, h, slots))
        break
    else:
      rounds.append([(s, h, slots)])
  return tuple(tuple((s, h) for s, h, _ in r) for r in rounds)


def make_plan(layout: layout_lib.UnitLayout, offloads: dict, mesh: jax.sharding.Mesh | None = None,
              *, chunk: int | None = None, rounds: tuple | None = None) -> OffloadPlan:
  """Builds (and places on `mesh`, if given) an offload plan for one unit kind.

  Args:
    layout: the unit layout (ownership does not change).
    offloads: {straggler: {helper: units}}; the straggler's last active units go to its helpers
      in helper order.
    mesh: places the arrays split over `tensor`; None keeps numpy arrays.
    chunk: K (static); default the largest units of one pair (at least 1).
    rounds: static permutations ((src, dst), ...) per round; every pair of `offloads` must be in
      one of them. Default: the fewest rounds for these pairs (greedy), which depends on the
      amounts; pass `static_shape(layout)` to compile once for every amount.

  Raises:
    LayoutError: `offload.<kind>` naming a bad device, share, chunk or a pair without a round.
  """
  f = f"offload.{layout.kind}"
  n, cap = layout.num_devices, layout.capacity
  keep, pairs = _pairs(f, layout, offloads)
  k = max([len(p[2]) for p in pairs], default=1) if chunk is None else int(chunk)
  if k < 1 or any(len(p[2]) > k for p in pairs):
    raise layout_lib.LayoutError(
        f"{f}: chunk {k} is smaller than a pair's share {max(len(p[2]) for p in pairs)}")
  perms = _greedy_rounds(pairs) if rounds is None else tuple(tuple(map(tuple, r)) for r in rounds)
  where = {}
  for i, r in enumerate(perms):
    for s, h in r:
      where.setdefault((s, h), i)
  send = np.full((n, max(len(perms), 1), k), cap, np.int32)
  count = np.zeros((n, max(len(perms), 1)), np.int32)
  for s, h, slots in pairs:
    if (s, h) not in where:
      raise layout_lib.LayoutError(f"{f}: no round sends from device {s} to helper {h}")
    i = where[(s, h)]
    send[s, i, :len(slots)] = slots
    count[h, i] = len(slots)
  arrays = (keep, send, count)
  if mesh is not None:
    arrays = tuple(mesh_lib.put(a, mesh, P(TENSOR)) for a in arrays)
  return OffloadPlan(*arrays, rounds=perms, chunk=k)


def for_target(layout: layout_lib.UnitLayout, target_counts: Sequence[int]) -> dict:
  """The offload {straggler: {helper: units}} after which device d computes target_counts[d].

  Devices whose active count is above their target send the difference to devices below
  theirs, greedily: the largest surplus to the largest deficit first (ties: lower device).

  Raises:
    LayoutError: `offload.<kind>.target` if it has the wrong length, a target < 1, or a sum
      other than the active units.
  """
  f = f"offload.{layout.kind}.target"
  target = [int(t) for t in target_counts]
  n = layout.num_devices
  if len(target) != n:
    raise layout_lib.LayoutError(f"{f}: {len(target)} entries for {n} devices")
  if min(target) < 1:
    raise layout_lib.LayoutError(f"{f}: every device must compute at least 1 unit, got {target}")
  if sum(target) != sum(layout.active):
    raise layout_lib.LayoutError(
        f"{f}: sums to {sum(target)}, but the devices compute {sum(layout.active)} units")
  diff = [a - t for a, t in zip(layout.active, target)]
  out: dict = {}
  while any(diff):
    s = max(range(n), key=lambda d: (diff[d], -d))
    h = min(range(n), key=lambda d: (diff[d], d))
    c = min(diff[s], -diff[h])
    out.setdefault(s, {})[h] = c
    diff[s] -= c
    diff[h] += c
  return out


def computed_counts(layout: layout_lib.UnitLayout, offloads: dict) -> tuple[int, ...]:
  """Units each device computes under `offloads` (its kept ones plus those it helps with)."""
  counts = list(layout.active)
  for s, helpers in offloads.items():
    for h, c in helpers.items():
      counts[s] -= c
      counts[h] += c
  return tuple(counts)


def step_bytes(offloads: dict, unit_bytes: dict) -> int:
  """Payload bytes sent per train step: the weights out, their gradients back (2x).

  Args:
    offloads: {kind: {straggler: {helper: units}}} (the `plan_lib.make_plan` host description).
    unit_bytes: {kind: bytes of one unit's weights, summed over every layer}.

  The compiled rounds (`static_shape`) send fixed chunks, zeros where a pair has no share;
  this counts only the units really offloaded, what a ragged transfer would move.
  """
  total = 0
  for kind, desc in offloads.items():
    if kind not in unit_bytes:
      raise ValueError(f"offload.unit_bytes: no bytes per unit for kind {kind!r}")
    units = sum(c for helpers in desc.values() for c in helpers.values())
    total += 2 * units * unit_bytes[kind]
  return int(total)


def no_offload(layout: layout_lib.UnitLayout, mesh=None) -> OffloadPlan:
  """A plan in which every device computes its own active units (for comparisons)."""
  return make_plan(layout, {}, mesh)


# --- inside shard_map -------------------------------------------------------------------------


def gather_units(w, axis: int, unit_size: int, slots):
  """Local units `slots` [K] of `w` (C*unit_size entries on `axis`) -> K*unit_size entries;
  a slot >= C reads zeros."""
  idx = (slots[:, None] * unit_size + jnp.arange(unit_size)).reshape(-1)
  return jnp.take(w, idx, axis=axis, mode="fill", fill_value=0)


def scatter_units(y, axis: int, unit_size: int, slots, values):
  """Adds `values` (K*unit_size on `axis`) into the local units `slots` of `y`; slots >= C drop."""
  idx = (slots[:, None] * unit_size + jnp.arange(unit_size)).reshape(-1)
  y = jnp.moveaxis(y, axis, 0)
  y = y.at[idx].add(jnp.moveaxis(values, axis, 0), mode="drop")
  return jnp.moveaxis(y, 0, axis)


def _varying(x):
  """x marked as varying over `tensor` (a no-op if it already is).

  Done once, outside the per-device `cond`/`switch` branches: otherwise the implicit cast of a
  replicated x sits inside each branch, its transpose (the all-reduce of dx) lands inside the
  transposed branches, and devices that take a branch without it deadlock in the rendezvous.
  """
  return mesh_lib.vary(x, (TENSOR,))


def _ppermute(x, perm):
  return jax.lax.ppermute(x, TENSOR, perm=list(perm))


def _send(plan: OffloadPlan, r: int, weights: Sequence, units: Sequence):
  """Round r: gathers this device's offloaded units of every weight and ppermutes them."""
  slots = plan.send[0, r]
  return [_ppermute(gather_units(w, axis, u, slots), plan.rounds[r])
          for w, (axis, u) in zip(weights, units)]


def column_parallel(plan: OffloadPlan, x, w, b, unit_size: int = 1):
  """Column-parallel GEMM y = x @ w + b with offloaded units.

  Args:
    plan: the local offload plan.
    x: [..., d_in] input, replicated over `tensor`.
    w: [d_in, C*unit_size] local column block; b: [C*unit_size].

  Returns:
    [..., C*unit_size] this device's output shard: its first `keep` units computed here, the
    offloaded ones computed by helpers and sent back; other slots zero.
  """
  keep = kernels.unit_mask(w.shape[1] // unit_size, plan.keep[0], w.dtype)
  keep = jnp.repeat(keep, unit_size)
  y = (x @ w + b) * keep
  for r, perm in enumerate(plan.rounds):
    w_off, b_off = _send(plan, r, (w, b), ((1, unit_size), (0, unit_size)))
    y_off = x @ w_off + b_off                                   # [..., K*u], zero if no share
    back = _ppermute(y_off, tuple((d, s) for s, d in perm))     # helper -> straggler
    y = scatter_units(y, y.ndim - 1, unit_size, plan.send[0, r], back)
  return y


def row_parallel_gemm(plan: OffloadPlan, h, w, unit_size: int = 1):
  """Row-parallel GEMM psum(h @ w) with offloaded units; the straggler sends its input shard.

  Args:
    plan: the local offload plan.
    h: [..., C*unit_size] this device's input shard (the column-parallel output).
    w: [C*unit_size, d_out] local row block.

  Returns:
    [..., d_out] the full output, replicated over `tensor`.
  """
  keep = jnp.repeat(kernels.unit_mask(w.shape[0] // unit_size, plan.keep[0], h.dtype), unit_size)
  y = (h * keep) @ w
  for r in range(len(plan.rounds)):
    h_off, w_off = _send(plan, r, (h, w), ((h.ndim - 1, unit_size), (0, unit_size)))
    y = y + h_off @ w_off
  return jax.lax.psum(y, TENSOR)


def helped_partial(plan: OffloadPlan, fn: Callable, x, weights: Sequence, units: Sequence):
  """The partial output of the units other devices offloaded to this one (zero if none).

  Args:
    fn: a partial block like `kernels.mlp_partial`: fn(width, x, *weights, active), whose output has
      x's shape (a column->row block maps d_model to d_model).
    x: the block input, replicated over `tensor`.
    weights: local padded blocks; units: per weight, static (unit axis, unit size).
  """
  x = _varying(x)
  y = None
  for r in range(len(plan.rounds)):
    recv = _send(plan, r, weights, units)
    n = plan.count[0, r]
    compute = jax.checkpoint(lambda x, recv, n: fn(plan.chunk, x, *recv, n))
    # Devices that receive nothing this round skip the compute; `n` makes the zeros vary over
    # `tensor` like the computed branch (shard_map's check_vma wants equal types).
    skip = lambda x, recv, n: jnp.zeros_like(x) + jnp.zeros((), x.dtype) * n
    y_r = jax.lax.cond(n > 0, compute, skip, x, recv, n)
    y = y_r if y is None else y + y_r
  return y


def block_partial(plan: OffloadPlan, widths: Sequence[int], fn: Callable, x, weights: Sequence,
                  units: Sequence):
  """This device's offload partial sum (before the all-reduce) and the width it executed.

  Args: as `row_parallel`.

  Returns:
    ([..., d_model] partial output, float32 scalar executed width: the bucket width >= keep
    plus `chunk` for every round in which this device computes a straggler's units).
  """
  keep = plan.keep[0]
  x = _varying(x)
  y = kernels.at_width(keep, tuple(widths), fn, x, *weights, keep)
  executed = jnp.asarray(widths, jnp.float32)[kernels.bucket_index(keep, tuple(widths))]
  if plan.rounds:
    y = y + helped_partial(plan, fn, x, weights, units)
    executed = executed + plan.chunk * jnp.sum(plan.count[0] > 0).astype(jnp.float32)
  return y, executed


def row_parallel(plan: OffloadPlan, widths: Sequence[int], fn: Callable, x, weights: Sequence,
                 units: Sequence):
  """`tp.row_parallel` with offload: own units at a bucket width, helpers' units, one psum.

  Args:
    plan: the local offload plan of this kind.
    widths: static compiled bucket widths (plan_lib.Plan.widths_of(kind)).
    fn: fn(width, x, *weights, active) -> [..., d_model] partial (kernels.mlp_partial, ...).
    x: activations, replicated over `tensor`.
    weights: local padded blocks; units: per weight, (unit axis, unit size).

  Returns:
    The full block output (without the output bias), replicated over `tensor`.
  """
  y, _ = block_partial(plan, widths, fn, x, weights, units)
  return jax.lax.psum(y, TENSOR)


def mlp_block(plan: OffloadPlan, widths, x, w1, b1, w2):
  """MLP block with offload. x: [..., d_model] replicated; w1 [d_model, C], b1 [C], w2 [C, d_model]
  local. Returns [..., d_model] replicated (without b2)."""
  return row_parallel(plan, widths, kernels.mlp_partial, x, (w1, b1, w2), kernels.MLP_UNITS)


def attention_block(plan: OffloadPlan, widths, x, wq, bq, wk, bk, wv, bv, wo, *, head_dim: int,
                    causal: bool):
  """Attention block with offloaded heads. x: [batch, seq, d_model] replicated; wq/wk/wv
  [d_model, C*head_dim], bq/bk/bv [C*head_dim], wo [C*head_dim, d_model] local. Returns
  [batch, seq, d_model] replicated (without bo)."""
  fn = functools.partial(kernels.attention_partial, head_dim=head_dim, causal=causal)
  return row_parallel(plan, widths, fn, x, (wq, bq, wk, bk, wv, bv, wo),
                      kernels.attention_units(head_dim))
