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
                   data_fields=("active", "slowdown"), meta_fields=("widths", "unit_ms"))
@dataclasses.dataclass(frozen=True)
class Plan:
  """What every tensor device computes in one step.

  Attributes:
    active: {kind: int32 [N]} leading slots each device computes ([1] locally in shard_map).
    slowdown: float32 [N] emulated slowdown factor per tensor device (1.0 = nominal), or None for
      no emulation ([1] locally).
    widths: ((kind, compute widths), ...), static: the compiled bucket widths.
    unit_ms: ((kind, ms), ...), static: emulated milliseconds per unit of executed width at
      slowdown 1 (forward plus backward); only used when `slowdown` is not None.
  """

  active: dict
  slowdown: jax.Array | None
  widths: tuple
  unit_ms: tuple = ()

  def widths_of(self, kind: str) -> tuple[int, ...]:
    return dict(self.widths)[kind]

  def unit_ms_of(self, kind: str) -> float:
    return dict(self.unit_ms).get(kind, 0.0)


def make_plan(layout: layout_lib.Layout, mesh: jax.sharding.Mesh, *, slowdown=None,
              unit_ms: dict | None = None) -> Plan:
  """The device-placed plan for `layout` (actives sharded over `tensor`)."""
  shard = NamedSharding(mesh, P(mesh_lib.TENSOR))
  active = {k: jax.device_put(np.asarray(u.active, np.int32), shard)
            for k, u in layout.kinds().items()}
  if slowdown is not None:
    slowdown = jax.device_put(np.asarray(slowdown, np.float32), shard)
  return Plan(active, slowdown, tuple((k, u.widths) for k, u in layout.kinds().items()),
              tuple(sorted((unit_ms or {}).items())))


def plan_specs(plan: Plan) -> Plan:
  """shard_map in_specs for a plan: every data leaf is split over `tensor`."""
  return jax.tree.map(lambda _: P(mesh_lib.TENSOR), plan)


def bucket_index(active: jax.Array, widths: tuple[int, ...]) -> jax.Array:
  """Index of the smallest width >= active (int32 scalar); widths are ascending."""
  return jnp.sum(active > jnp.asarray(widths[:-1], active.dtype)).astype(jnp.int32)


def at_width(active: jax.Array, widths: tuple[int, ...], fn: Callable, *operands):
  """Runs `fn(width, *operands)` at this device's bucket width (see module doc).

  Args:
    active: int32 scalar, units this device computes.
    widths: static ascending bucket widths.
    fn: fn(width, *operands) -> outputs; all widths must give outputs of the same shape.
  """
  if len(widths) == 1:
    return fn(widths[0], *operands)
  branches = [jax.checkpoint(functools.partial(fn, w)) for w in widths]
  return jax.lax.switch(bucket_index(active, widths), branches, *operands)


def unit_mask(width: int, active: jax.Array, dtype) -> jax.Array:
  """[width] 1.0 on the first `active` slots, 0.0 after."""
  return (jnp.arange(width) < active).astype(dtype)


def mlp_partial(width, x, w1, b1, w2, active):
  """This device's partial MLP output, computed at `width` units.

  Args:
    width: static compute width (<= C).
    x: [..., d_model] activations (replicated over `tensor`).
    w1: [d_model, C] local column block; b1: [C]; w2: [C, d_model] local row block.
    active: int32 scalar; slots >= active contribute zero.

  Returns:
    [..., d_model] partial sum (before the all-reduce, without the output bias).
  """
  h = x @ w1[:, :width] + b1[:width]
  h = jax.nn.gelu(h) * unit_mask(width, active, h.dtype)
  return h @ w2[:width]


def attention_partial(width, x, wq, bq, wk, bk, wv, bv, wo, active, *, head_dim, causal):
  """This device's partial attention output, computed at `width` heads.

  Args:
    width: static compute width in heads (<= C).
    x: [batch, seq, d_model] activations (replicated over `tensor`).
    wq, wk, wv: [d_model, C*head_dim] local column blocks; bq, bk, bv: [C*head_dim];
    wo: [C*head_dim, d_model] local row block.
    active: int32 scalar; heads >= active contribute zero.
    head_dim: features per head. causal: mask future positions.

  Returns:
    [batch, seq, d_model] partial sum (before the all-reduce, without the output bias).
  """
  n = width * head_dim
  heads = lambda w, b: (x @ w[:, :n] + b[:n]).reshape(*x.shape[:-1], width, head_dim)
  q, k, v = heads(wq, bq), heads(wk, bk), heads(wv, bv)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q / math.sqrt(head_dim), k)
  if causal:
    seq = x.shape[-2]
    keep = jnp.tril(jnp.ones((seq, seq), bool))
    logits = jnp.where(keep, logits, jnp.finfo(logits.dtype).min)
  probs = jax.nn.softmax(logits, axis=-1)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
  out = out * unit_mask(width, active, out.dtype)[:, None]
  return out.reshape(*x.shape[:-1], n) @ wo[:n]


def row_parallel(plan: Plan, kind: str, fn: Callable, x, *weights):
  """Runs a column->row parallel block on this device's units and all-reduces the result.

  Args:
    plan: the local plan (inside shard_map).
    kind: "mlp" or "heads".
    fn: a partial function like `mlp_partial`: fn(width, x, *weights, active).
    x: activations, replicated over `tensor`.
    weights: local padded blocks.

  Returns:
    The full block output, replicated over `tensor`.
  """
  active = plan.active[kind][0]
  widths = plan.widths_of(kind)
  y = at_width(active, widths, fn, x, *weights, active)
  if plan.slowdown is not None:
    executed = jnp.asarray(widths, jnp.float32)[bucket_index(active, widths)]
    y = hetero.straggle(y, plan.unit_ms_of(kind) * executed * plan.slowdown[0])
  return jax.lax.psum(y, mesh_lib.TENSOR)
