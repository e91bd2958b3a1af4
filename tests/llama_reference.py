"""An independent dense Llama forward pass in plain jax.numpy, written from the math.

Nothing here imports semijax. It reads the logical parameters (a pure dict, the layout-independent
form the engine's `logical_arrays` returns) by name, with these shapes (G KV heads, g = H / G
query heads per KV head, hd = d_model / H):

  embed.embedding [vocab, d_model]; head.kernel [d_model, vocab] (absent when tied);
  encoder.final_norm.scale [d_model]; per block: attn_norm.scale, mlp_norm.scale [d_model],
  attn.wq [d_model, G, g*hd], attn.wk, attn.wv [d_model, G, hd], attn.wo [G, g*hd, d_model],
  mlp.w_gate, mlp.w_up [d_model, d_ff], mlp.w_down [d_ff, d_model].

Query head j of KV group c is wq[:, c, j*hd:(j+1)*hd]. Rotary embeddings pair feature i with
i + hd/2, rotated as the complex number x_i + 1j*x_{i+hd/2} times exp(1j * pos * 10000^(-2i/hd)).
Being a function of the parameters, `jax.grad` of `loss` gives gradients in the same tree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

EPS = 1e-5
THETA = 10000.0


def rms_norm(x, scale):
  """x [..., d] -> x / sqrt(mean(x^2) + EPS) * scale."""
  return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + EPS) * scale


def rotary(x):
  """x [batch, seq, heads, hd] rotated by position (complex form, see module doc)."""
  seq, hd = x.shape[1], x.shape[-1]
  half = hd // 2
  inv_freq = 1.0 / THETA ** (jnp.arange(half) * 2.0 / hd)
  phase = jnp.exp(1j * jnp.arange(seq)[:, None] * inv_freq[None, :])      # [seq, half]
  z = (x[..., :half] + 1j * x[..., half:]) * phase[None, :, None, :]
  return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def attention(x, p, num_heads):
  """Causal grouped-query attention of x [batch, seq, d_model] -> [batch, seq, d_model]."""
  b, s, _ = x.shape
  groups, hd = p["wk"].shape[1], p["wk"].shape[2]
  g = num_heads // groups
  q = jnp.einsum("bsd,dcn->bscn", x, p["wq"]).reshape(b, s, groups * g, hd)
  k = jnp.einsum("bsd,dcn->bscn", x, p["wk"])
  v = jnp.einsum("bsd,dcn->bscn", x, p["wv"])
  q = rotary(q).reshape(b, s, groups, g, hd)
  k = rotary(k)
  scores = jnp.einsum("bqcjh,bkch->bcjqk", q, k) / jnp.sqrt(float(hd))
  causal = jnp.tril(jnp.ones((s, s), bool))
  probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
  out = jnp.einsum("bcjqk,bkch->bqcjh", probs, v).reshape(b, s, groups, g * hd)
  return jnp.einsum("bscn,cnd->bsd", out, p["wo"])


def swiglu(x, p):
  """silu(x @ w_gate) * (x @ w_up) @ w_down."""
  gate = x @ p["w_gate"]
  return (gate * jax.nn.sigmoid(gate) * (x @ p["w_up"])) @ p["w_down"]


def logits(params, tokens, num_heads):
  """tokens int32 [batch, seq] -> logits [batch, seq, vocab]."""
  table = params["embed"]["embedding"]
  x = table[tokens]
  enc = params["encoder"]
  for i in sorted(enc["blocks"]):
    blk = enc["blocks"][i]
    x = x + attention(rms_norm(x, blk["attn_norm"]["scale"]), blk["attn"], num_heads)
    x = x + swiglu(rms_norm(x, blk["mlp_norm"]["scale"]), blk["mlp"])
  x = rms_norm(x, enc["final_norm"]["scale"])
  head = params["head"]["kernel"] if "head" in params else table.T
  return x @ head


def loss(params, batch, num_heads):
  """Mean next-token cross-entropy over batch["inputs"] -> batch["targets"], and the logits."""
  out = logits(params, batch["inputs"], num_heads)
  logp = jax.nn.log_softmax(out, axis=-1)
  nll = -jnp.take_along_axis(logp, batch["targets"][..., None], axis=-1)
  return jnp.mean(nll), out


def logits_and_grads(params, batch, num_heads):
  """Reference logits and gradients of `loss` (a tree like `params`), in one program."""
  fn = jax.jit(jax.grad(lambda p: loss(p, batch, num_heads), has_aux=True))
  grads, out = fn(params)
  return out, grads
