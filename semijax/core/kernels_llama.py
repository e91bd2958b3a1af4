"""Per-device kernels of a Llama-style block: the SwiGLU MLP and grouped-query attention with
rotary position embeddings, at bucketed widths (`core.kernels` has the design; these run inside
`jax.shard_map`, through `tp.row_parallel`, like `kernels.mlp_partial`).

Units: an MLP unit is one hidden unit of the gate and up projections with its row of the down
projection; an attention unit is one KV group: its key and value head and the `group` query heads
that share them, so a device never splits a group. The attention weights keep the group axis
explicit (local: wq [d_model, C, group*head_dim], wk, wv [d_model, C, head_dim], wo
[C, group*head_dim, d_model]), so one unit is one index of that axis (unit size 1 in
`core.sharding`, `GQA_UNITS`). Inside a kernel they are viewed flat ([d_model, C*group*head_dim],
...) and go through the GPT's column and row GEMMs (`kernels.column`, `kernels.row`: exact at a
bucket width, ZERO-resized, or the pallas kernel's width None), each with its own entries per
unit, without biases.

Rotary embeddings (`rope`) rotate this device's query and key heads after the column GEMMs, in
float32; the scores and the softmax are float32 (`jax.nn.dot_product_attention`, as the GPT's).
As in `kernels.attention_partial`, under the pallas kernel a device with no active group skips
the scores and the softmax over its C zero groups where the plan asks (`skip_idle`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from semijax.core import kernels

ROPE_THETA = 10000.0
SWIGLU_UNITS = ((1, 1), (1, 1), (0, 1))          # (unit axis, unit size) of w_gate, w_up, w_down
GQA_UNITS = ((1, 1), (1, 1), (1, 1), (0, 1))     # of wq, wk, wv, wo: one KV group per index


def rope(x: jax.Array, theta: float = ROPE_THETA, offset=0) -> jax.Array:
  """Rotary position embedding of x [..., seq, heads, head_dim] at positions offset ..
  offset + seq - 1 (`offset` an int or int32 scalar: where a decoding step's tokens sit).

  The halves convention: feature i < head_dim/2 pairs with i + head_dim/2 and the pair turns by
  position * theta^(-2i/head_dim). Computed in float32, returned in x's dtype.
  """
  seq, head_dim = x.shape[-3], x.shape[-1]
  half = head_dim // 2
  freq = theta ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / head_dim)      # [half]
  position = (jnp.arange(seq) + offset).astype(jnp.float32)
  angle = (position[:, None] * freq)[:, None, :]                               # [seq, 1, half]
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def swiglu_partial(width, x, w_gate, w_up, w_down, active, cut: kernels.Cut | None = None):
  """This device's partial SwiGLU output, silu(x @ w_gate) * (x @ w_up) @ w_down, at `width`.

  Args:
    width: static compute width in hidden units (<= C), or None (the pallas kernel: C, skipping
      the units >= active; no `cut`).
    x: [..., d_model] activations (replicated over `tensor`).
    w_gate, w_up: [d_model, C] local column blocks; w_down: [C, d_model] local row block.
    active: int32 scalar; units >= active contribute zero.
    cut: what a resized device leaves out (`kernels.Cut`), or None for the exact block.

  Returns:
    [..., d_model] partial sum (before the all-reduce).
  """
  limit, width = kernels.kernel_width(width, active, cut, w_gate.shape[1])
  gate = kernels.column(x, w_gate, None, width, 1, cut, limit)
  up = kernels.column(x, w_up, None, width, 1, cut, limit)
  h = jax.nn.silu(gate) * up
  h = h * kernels.unit_mask(width, kernels.computed(width, active, cut), h.dtype)
  return kernels.row(h[..., None], w_down, width, 1, cut, limit)


def gqa_partial(width, x, wq, wk, wv, wo, active, cut: kernels.Cut | None = None, *,
                implementation: str = "xla", skip_idle: bool = False):
  """This device's partial grouped-query attention output (causal, rotary), at `width` groups.

  Args:
    width: static compute width in KV groups (<= C; 0 computes nothing), or None (the pallas
      kernel: C, skipping the groups >= active in the projections; no `cut`).
    x: [batch, seq, d_model] activations (replicated over `tensor`).
    wq: [d_model, C, group*head_dim]; wk, wv: [d_model, C, head_dim] local column blocks;
      wo: [C, group*head_dim, d_model] local row block (query head j of group c is
      wq[:, c, j*head_dim:(j+1)*head_dim] and wo[c, j*head_dim:(j+1)*head_dim]).
    active: int32 scalar; groups >= active contribute zero.
    cut: what a resized device leaves out (`kernels.Cut`), or None for the exact block.
    implementation: of `jax.nn.dot_product_attention`, "xla" or "cudnn".
    skip_idle: with width None, a device with no active group skips the scores and the softmax
      (`mesh.cond_or_zeros`): set under a plan in which a device may own no group (`Plan.idle`).

  Returns:
    [batch, seq, d_model] partial sum (before the all-reduce).
  """
  d_model, capacity, q_size = wq.shape
  head_dim = wk.shape[2]
  group = q_size // head_dim
  pallas = width is None
  limit, width = kernels.kernel_width(width, active, cut, capacity)

  def column(w, size, heads):          # [d_model, C, size] -> [batch, seq, heads, head_dim]
    flat = w.reshape(d_model, capacity * size)
    y = kernels.column(x, flat, None, width, size, cut, limit)
    return y.reshape(*x.shape[:-1], heads, head_dim)

  q = rope(column(wq, q_size, width * group))
  k = rope(column(wk, head_dim, width))
  v = column(wv, head_dim, width)
  # Query head c*group + j attends with KV head c.
  out = kernels.attention_core(q, k, v, active, causal=True, implementation=implementation,
                               skip=pallas and skip_idle)
  out = out.reshape(*x.shape[:-1], width, q_size)
  if cut is None:     # the row GEMM's input, kept by a branch (`kernels.saved`)
    out = kernels.saved(out.reshape(*x.shape[:-1], width * q_size),
                        capacity * q_size).reshape(out.shape)
  out = out * kernels.unit_mask(width, kernels.computed(width, active, cut), out.dtype)[:, None]
  return kernels.row(out, wo.reshape(capacity * q_size, d_model), width, q_size, cut, limit)
