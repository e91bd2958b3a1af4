"""An independent dense reference: the same GPT and ViT from standard Flax NNX layers, one device.

Nothing here imports semijax: attention is `nnx.MultiHeadAttention`, the MLP two `nnx.Linear`s,
the ViT patch embedding an `nnx.Conv`. `to_reference` / `from_reference` convert between semijax
logical parameters and this model's parameters, so forward passes and gradients can be compared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):

  def __init__(self, d_model, num_heads, d_ff, causal, rngs):
    self.causal = causal
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=num_heads, in_features=d_model, decode=False,
                                       rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.fc1 = nnx.Linear(d_model, d_ff, rngs=rngs)
    self.fc2 = nnx.Linear(d_ff, d_model, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2])) if self.causal else None
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))


class GPT(nnx.Module):

  def __init__(self, *, vocab_size=256, seq_len, d_model, num_heads, d_ff, num_layers, rngs):
    self.embed = nnx.Embed(vocab_size, d_model, rngs=rngs)
    self.pos = nnx.Param(jnp.zeros((seq_len, d_model)))
    self.blocks = nnx.List([Block(d_model, num_heads, d_ff, True, rngs)
                            for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[: tokens.shape[1]]
    for b in self.blocks:
      x = b(x)
    return self.head(self.ln_f(x))


class ViT(nnx.Module):

  def __init__(self, *, image_size, patch_size, channels, num_classes, d_model, num_heads, d_ff,
               num_layers, rngs):
    n = (image_size // patch_size) ** 2
    self.patch = nnx.Conv(channels, d_model, kernel_size=(patch_size, patch_size),
                          strides=(patch_size, patch_size), padding="VALID", rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, d_model)))
    self.pos = nnx.Param(jnp.zeros((n + 1, d_model)))
    self.blocks = nnx.List([Block(d_model, num_heads, d_ff, False, rngs)
                            for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)
    self.head = nnx.Linear(d_model, num_classes, rngs=rngs)

  def __call__(self, images):
    x = self.patch(images)
    x = x.reshape(x.shape[0], -1, x.shape[-1])
    cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + self.pos[...]
    for b in self.blocks:
      x = b(x)
    return self.head(self.ln_f(x)[:, 0])


def _block_to_ref(p, num_heads):
  a, m = p["attn"], p["mlp"]
  split = lambda w: w.reshape(w.shape[0], num_heads, -1)      # [d, H*hd] -> [d, H, hd]
  heads = lambda b: b.reshape(num_heads, -1)                  # [H*hd] -> [H, hd]
  return {
      "ln1": p["ln1"], "ln2": p["ln2"],
      "attn": {"query": {"kernel": split(a["wq"]), "bias": heads(a["bq"])},
               "key": {"kernel": split(a["wk"]), "bias": heads(a["bk"])},
               "value": {"kernel": split(a["wv"]), "bias": heads(a["bv"])},
               "out": {"kernel": a["wo"].reshape(num_heads, -1, a["wo"].shape[-1]),
                       "bias": a["bo"]}},
      "fc1": {"kernel": m["w1"], "bias": m["b1"]},
      "fc2": {"kernel": m["w2"], "bias": m["b2"]},
  }


def _block_from_ref(r):
  a = r["attn"]
  merge = lambda w: w.reshape(w.shape[0], -1)
  return {
      "ln1": r["ln1"], "ln2": r["ln2"],
      "attn": {"wq": merge(a["query"]["kernel"]), "bq": a["query"]["bias"].reshape(-1),
               "wk": merge(a["key"]["kernel"]), "bk": a["key"]["bias"].reshape(-1),
               "wv": merge(a["value"]["kernel"]), "bv": a["value"]["bias"].reshape(-1),
               "wo": a["out"]["kernel"].reshape(-1, a["out"]["kernel"].shape[-1]),
               "bo": a["out"]["bias"]},
      "mlp": {"w1": r["fc1"]["kernel"], "b1": r["fc1"]["bias"], "w2": r["fc2"]["kernel"],
              "b2": r["fc2"]["bias"]},
  }


def to_reference(params: dict, num_heads: int) -> dict:
  """semijax logical params (pure dict) -> this module's pure dict."""
  enc = params["encoder"]
  out = {"blocks": {i: _block_to_ref(b, num_heads) for i, b in enc["blocks"].items()},
         "ln_f": enc["ln_f"], "pos": params["pos"], "head": params["head"]}
  if "embed" in params:
    out["embed"] = params["embed"]
  else:
    out["cls"] = params["cls"]
    out["patch"] = params["patch"]
  return out


def from_reference(ref: dict) -> dict:
  """This module's pure dict (e.g. gradients) -> semijax logical layout."""
  out = {"encoder": {"blocks": {i: _block_from_ref(b) for i, b in ref["blocks"].items()},
                     "ln_f": ref["ln_f"]},
         "pos": ref["pos"], "head": ref["head"]}
  for k in ("embed", "cls"):
    if k in ref:
      out[k] = ref[k]
  if "patch" in ref:
    kern = ref["patch"]["kernel"]
    out["patch"] = {"kernel": kern.reshape(-1, kern.shape[-1]), "bias": ref["patch"]["bias"]}
  return out


def build(model_cls, params: dict, **model_kw):
  """A reference model of `model_cls` holding semijax logical `params`."""
  num_heads = model_kw["num_heads"]
  model = nnx.eval_shape(lambda: model_cls(rngs=nnx.Rngs(0), **model_kw))
  graphdef, state = nnx.split(model)
  ref = to_reference(params, num_heads)
  if "patch" in ref:
    shape = state["patch"]["kernel"].shape
    ref["patch"] = {"kernel": ref["patch"]["kernel"].reshape(shape), "bias": ref["patch"]["bias"]}
  return graphdef, ref


def apply(graphdef, ref_params, inputs):
  return nnx.merge(graphdef, ref_params)(inputs)
