"""The byte-level GPT written the standard way in plain JAX: a pure function of a parameter dict.

The peer that `benchmarks/peer.py` times semijax against. Nothing here imports semijax: no
shard_map, no layouts, no Flax modules. The model is the same as semijax's GPT (pre-LayerNorm
blocks, learned position embedding, GELU MLP, biases everywhere but the untied output head).

Precision as in mixed-precision training: parameters are stored in float32 (the master weights
the optimizer updates) and cast to the compute dtype `dtype` where they are read; activations
and GEMMs run in `dtype`; LayerNorm statistics, the attention softmax, the logits and the loss
are float32. Attention is `jax.nn.dot_product_attention` with the given `implementation`.

Parameters (`Params`, a plain dict; D = d_model, F = d_ff, V = vocab, S = seq_len):
  embed [V, D], pos [S, D], head [D, V], ln_f {scale, bias} [D], and blocks: a list of
  {ln1, ln2: {scale, bias} [D]; attn: wq, wk, wv [D, D], bq, bk, bv [D], wo [D, D], bo [D];
   mlp: w1 [D, F], b1 [F], w2 [F, D], b2 [D]}.
Heads are contiguous column blocks of wq, wk, wv (head h: columns [h*D/H, (h+1)*D/H)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

LN_EPSILON = 1e-6


def layer_norm(x, p, dtype):
  """x [..., D] -> [..., D] in `dtype`; statistics and normalization in float32."""
  x = x.astype(jnp.float32)
  mean = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + LN_EPSILON) * p["scale"] + p["bias"]
  return y.astype(dtype)


def attention(x, p, num_heads, dtype, implementation):
  """Causal self-attention: x [B, S, D] -> [B, S, D] in `dtype`."""
  b, s, d = x.shape
  w = lambda name: p[name].astype(dtype)
  split = lambda t: t.reshape(b, s, num_heads, d // num_heads)        # [B, S, H, D/H]
  q, k, v = (split(x @ w(f"w{n}") + w(f"b{n}")) for n in "qkv")
  out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)
  return out.reshape(b, s, d) @ w("wo") + w("bo")


def mlp(x, p, dtype):
  """x [B, S, D] -> [B, S, D]: GELU (tanh approximation) between two GEMMs, in `dtype`."""
  w = lambda name: p[name].astype(dtype)
  return jax.nn.gelu(x @ w("w1") + w("b1")) @ w("w2") + w("b2")


def logits(params, tokens, *, num_heads, dtype=jnp.float32, implementation="xla"):
  """tokens int32 [B, S] -> float32 logits [B, S, V]."""
  x = jnp.take(params["embed"].astype(dtype), tokens, axis=0)
  x = x + params["pos"][: tokens.shape[1]].astype(dtype)
  for p in params["blocks"]:
    x = x + attention(layer_norm(x, p["ln1"], dtype), p["attn"], num_heads, dtype,
                      implementation)
    x = x + mlp(layer_norm(x, p["ln2"], dtype), p["mlp"], dtype)
  x = layer_norm(x, params["ln_f"], dtype)
  return jnp.matmul(x, params["head"].astype(dtype), preferred_element_type=jnp.float32)


def cross_entropy(logits, targets):
  """Mean next-token cross-entropy (float32) of logits [B, S, V] against int32 targets [B, S]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32))
  return jnp.mean(-jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0])


def loss(params, batch, **model):
  """Mean next-token cross-entropy (float32) of batch {"inputs", "targets": int32 [B, S]};
  `model` as for `logits`."""
  return cross_entropy(logits(params, batch["inputs"], **model), batch["targets"])


def train_step(params, opt_state, batch, *, tx, loss_fn=loss, **model):
  """One AdamW step (`tx`, an optax transformation) on `loss_fn` (default this GPT's loss):
  (params, opt_state, loss)."""
  value, grads = jax.value_and_grad(loss_fn)(params, batch, **model)
  updates, opt_state = tx.update(grads, opt_state, params)
  params = jax.tree.map(lambda p, u: p + u, params, updates)
  return params, opt_state, value
