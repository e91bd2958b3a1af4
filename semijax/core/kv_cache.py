"""Attention with a key/value cache, for decoding: new tokens attend over the keys and values of
every token read before them, which are kept rather than recomputed.

These run inside `jax.shard_map` on a device's local, padded blocks, like `kernels` (the
training kernels), but always at the full capacity C of heads (or KV groups), with no
per-device width: padded slots hold zero weights (the layout's invariant), so their queries,
keys and values are zero and add nothing to the row GEMM, and every owned unit counts. A
decoding step reads a few tokens, so the width a device computes matters little there.

A layer's cache is (keys, values), each [batch, length, C, head_dim] local (the device's heads
or KV groups), in the compute dtype; `length` is the model's context. Tokens at positions
pos .. pos + T - 1 write their keys and values there and attend to every position <= their own;
what lies past them in the cache (zeros, or what an earlier, longer read left) is masked out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from semijax.core import kernels_llama
from semijax.core import mesh as mesh_lib


def empty(batch: int, length: int, heads: int, head_dim: int, dtype) -> tuple:
  """A layer's empty cache: zero keys and values [batch, length, heads, head_dim]."""
  zeros = jnp.zeros((batch, length, heads, head_dim), dtype)
  return zeros, zeros


def attend(q, k, v, cache: tuple, pos) -> tuple:
  """Writes k, v [batch, T, kv_heads, head_dim] into `cache` at positions pos .. pos + T - 1 and
  attends q [batch, T, heads, head_dim] (kv_heads divides heads: query head h reads key head
  h // (heads / kv_heads)) over every cached position <= its own (float32 softmax,
  `jax.nn.dot_product_attention`). Returns (out [batch, T, heads, head_dim], the new cache)."""
  keys, values = (jax.lax.dynamic_update_slice_in_dim(c, x.astype(c.dtype), pos, axis=1)
                  for c, x in zip(cache, (k, v)))
  t, length = q.shape[1], keys.shape[1]
  visible = jnp.arange(length)[None, :] <= pos + jnp.arange(t)[:, None]            # [T, length]
  out = jax.nn.dot_product_attention(q, keys, values, mask=visible[None, None],
                                     implementation="xla")
  return out, (keys, values)


def gpt_attention(x, wq, bq, wk, bk, wv, bv, wo, cache: tuple, pos, *, head_dim: int):
  """A GPT block's attention of x [batch, T, d_model] (replicated over `tensor`) at positions
  pos .. pos + T - 1, on local blocks wq, wk, wv [d_model, C*head_dim], bq, bk, bv
  [C*head_dim], wo [C*head_dim, d_model]. Returns (output [batch, T, d_model] summed over
  `tensor`, without the output bias; the new cache)."""
  heads = lambda w, b: (x @ w + b).reshape(*x.shape[:-1], -1, head_dim)
  out, cache = attend(heads(wq, bq), heads(wk, bk), heads(wv, bv), cache, pos)
  y = out.reshape(*x.shape[:-1], -1) @ wo
  return jax.lax.psum(y, mesh_lib.TENSOR), cache


def grouped_attention(x, wq, wk, wv, wo, cache: tuple, pos):
  """A Llama block's grouped-query attention of x [batch, T, d_model] at positions
  pos .. pos + T - 1 (rotary embeddings at those positions), on local blocks wq
  [d_model, C, group*head_dim], wk, wv [d_model, C, head_dim], wo [C, group*head_dim, d_model]
  (`kernels_llama.gqa_partial` has the layout). Returns (output [batch, T, d_model] summed
  over `tensor`; the new cache)."""
  d_model, capacity, q_size = wq.shape
  head_dim = wk.shape[2]
  heads = lambda w: (x @ w.reshape(d_model, -1)).reshape(*x.shape[:-1], -1, head_dim)
  q = kernels_llama.rope(heads(wq), offset=pos)
  k = kernels_llama.rope(heads(wk), offset=pos)
  out, cache = attend(q, k, heads(wv), cache, pos)
  y = out.reshape(*x.shape[:-1], capacity * q_size) @ wo.reshape(capacity * q_size, d_model)
  return jax.lax.psum(y, mesh_lib.TENSOR), cache
