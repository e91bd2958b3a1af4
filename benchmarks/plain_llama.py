"""The byte-level Llama written the standard way in plain JAX: a pure function of a parameter dict.

The peer that `benchmarks/peer.py` times semijax's Llama against (`--model=llama`). Nothing here
imports semijax: no shard_map, no layouts, no Flax modules. The model is the same as semijax's
Llama (pre-RMSNorm blocks, grouped-query attention with rotary embeddings, SwiGLU MLP, no biases,
an untied output head). Precision as in `plain_gpt`: float32 master weights cast to `dtype`
where read, GEMMs in `dtype`; RMSNorm statistics, rotary embeddings, the attention softmax, the
logits and the loss in float32.

Parameters (a plain dict; D = d_model, F = d_ff, V = vocab, G = KV heads, g = query heads per KV
head, hd = head_dim):
  embed [V, D], head [D, V], final_norm [D], and blocks: a list of
  {attn_norm, mlp_norm [D]; attn: wq [D, G, g*hd], wk, wv [D, G, hd], wo [G, g*hd, D];
   mlp: w_gate, w_up [D, F], w_down [F, D]}.
Query head j of KV group c is wq[:, c, j*hd:(j+1)*hd]; rotary embeddings pair feature i with
i + hd/2 (theta 10,000).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from benchmarks import plain_gpt

RMS_EPSILON = 1e-5
ROPE_THETA = 10000.0


def rms_norm(x, scale, dtype):
  """x [..., D] -> [..., D] in `dtype`; statistics and normalization in float32."""
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + RMS_EPSILON) * scale
  return y.astype(dtype)


def rope(x):
  """x [B, S, heads, hd] rotated by position (float32 inside, x's dtype out)."""
  s, hd = x.shape[1], x.shape[-1]
  half = hd // 2
  freq = ROPE_THETA ** (-2.0 * jnp.arange(half, dtype=jnp.float32) / hd)
  angle = (jnp.arange(s, dtype=jnp.float32)[:, None] * freq)[:, None, :]     # [S, 1, half]
  x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  cos, sin = jnp.cos(angle), jnp.sin(angle)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def attention(x, p, dtype, implementation):
  """Causal grouped-query attention: x [B, S, D] -> [B, S, D] in `dtype`."""
  b, s, d = x.shape
  hd = p["wk"].shape[-1]
  proj = lambda name: x @ p[name].astype(dtype).reshape(d, -1)
  q = rope(proj("wq").reshape(b, s, -1, hd))            # [B, S, H, hd]: head c*g + j
  k = rope(proj("wk").reshape(b, s, -1, hd))            # [B, S, G, hd]
  v = proj("wv").reshape(b, s, -1, hd)
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  return out.reshape(b, s, -1) @ p["wo"].astype(dtype).reshape(-1, d)


def mlp(x, p, dtype):
  """x [B, S, D] -> [B, S, D]: SwiGLU, silu(x @ w_gate) * (x @ w_up) @ w_down, in `dtype`."""
  w = lambda name: p[name].astype(dtype)
  return (jax.nn.silu(x @ w("w_gate")) * (x @ w("w_up"))) @ w("w_down")


def logits(params, tokens, *, dtype=jnp.float32, implementation="xla", **unused):
  """tokens int32 [B, S] -> float32 logits [B, S, V] (`unused`: `plain_gpt`'s num_heads)."""
  del unused
  x = jnp.take(params["embed"].astype(dtype), tokens, axis=0)
  for p in params["blocks"]:
    x = x + attention(rms_norm(x, p["attn_norm"], dtype), p["attn"], dtype, implementation)
    x = x + mlp(rms_norm(x, p["mlp_norm"], dtype), p["mlp"], dtype)
  x = rms_norm(x, params["final_norm"], dtype)
  return jnp.matmul(x, params["head"].astype(dtype), preferred_element_type=jnp.float32)


def loss(params, batch, **model):
  """Mean next-token cross-entropy (float32) of batch {"inputs", "targets": int32 [B, S]};
  `model` as for `logits`."""
  return plain_gpt.cross_entropy(logits(params, batch["inputs"], **model), batch["targets"])


# One AdamW step (`tx`, an optax transformation) on this Llama's loss: (params, opt_state, loss).
train_step = functools.partial(plain_gpt.train_step, loss_fn=loss)
