"""A causal byte-level GPT with uneven tensor-parallel heads and MLP units."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from semijax.core import plan as plan_lib
from semijax.core import spec as spec_lib
from semijax.models import checks
from semijax.models import layers
from semijax.models import tasks


class GPT(nnx.Module):
  """Decoder-only language model: token + learned position embeddings, blocks, linear head.

  Call: tokens int32 [batch, seq] (seq <= seq_len) -> logits float32 [batch, seq, vocab_size].
  Embeddings, LayerNorms and the head are replicated over `tensor`; batch is split over `data`.
  The blocks compute in `precision.dtype`; the head's GEMM accumulates into float32 logits.
  """

  input_key = "inputs"
  # The modules `stem` and `head_out` read: a drained device skips them (`core.repeated`).
  stem_paths = ("embed", "pos")
  head_paths = ("ln_f", "head")
  FIELDS = ("vocab_size", "seq_len", "d_model", "num_heads", "d_ff", "num_layers")
  loss_terms = staticmethod(tasks.language_model)

  @classmethod
  def spec(cls, **fields) -> spec_lib.ModelSpec:
    """The validated spec of a GPT with these config fields (ConfigError naming a bad one)."""
    f = checks.positive_fields("gpt", cls.FIELDS, fields)
    checks.heads_divide_width(f)
    return spec_lib.ModelSpec("gpt", tuple((k, f[k]) for k in cls.FIELDS), f["d_model"],
                              f["num_heads"], f["d_ff"], f["num_layers"], seq_len=f["seq_len"],
                              causal=True, items_per_example=f["seq_len"], unit="tokens")

  def __init__(self, *, vocab_size: int = 256, seq_len: int, d_model: int, num_heads: int,
               d_ff: int, num_layers: int, precision: layers.Precision = layers.Precision(),
               rngs: nnx.Rngs):
    self.head_dim = d_model // num_heads
    self.precision = precision
    self.embed = nnx.Embed(vocab_size, d_model, dtype=precision.compute,
                           param_dtype=precision.storage, rngs=rngs)
    self.pos = layers.param(nnx.initializers.normal(0.02), rngs, (seq_len, d_model),
                            (None, "embed"), precision)
    self.encoder = layers.Encoder(num_layers, d_model, num_heads, d_ff, causal=True,
                                  precision=precision, rngs=rngs)
    self.head = layers.head(d_model, vocab_size, False, precision, rngs)

  def __call__(self, tokens: jnp.ndarray, plan: plan_lib.Plan) -> jnp.ndarray:
    return self.head_out(self.encoder.run_blocks(self.stem(tokens), plan))

  def stem(self, tokens: jnp.ndarray) -> jnp.ndarray:
    """int32 [batch, seq] -> [batch, seq, d_model] (compute dtype): what the first block sees."""
    pos = layers.read((self.pos,), self.precision)[0]
    return self.embed(tokens) + pos[: tokens.shape[-1]]

  def head_out(self, x: jnp.ndarray) -> jnp.ndarray:
    """The last block's output [batch, seq, d_model] -> logits [batch, seq, vocab_size]."""
    return self.head(self.encoder.ln_f(x))

  def init_cache(self, batch: int, length: int) -> list:
    """Every block's empty key/value cache [batch, length, C, head_dim] (local)."""
    return layers.init_cache(self.encoder.blocks, batch, length)

  def decode(self, tokens: jnp.ndarray, cache: list, pos, plan: plan_lib.Plan):
    """tokens int32 [batch, T] at positions pos .. pos + T - 1 (pos + T <= seq_len), after the
    tokens whose keys and values `cache` holds -> (logits float32 [batch, T, vocab_size], the
    cache with theirs too)."""
    table = layers.read((self.pos,), self.precision)[0]
    x = self.embed(tokens) + jax.lax.dynamic_slice_in_dim(table, pos, tokens.shape[-1])
    x, cache = layers.decode_blocks(self.encoder.blocks, x, cache, pos, plan)
    return self.head_out(x), cache

  def unit_sizes(self) -> dict:
    """Entries per unit along each unit axis."""
    return {"mlp": 1, "heads": self.head_dim}
