"""A causal Llama-style language model with uneven tensor-parallel KV groups and MLP units."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from semijax.core import plan as plan_lib
from semijax.core import spec as spec_lib
from semijax.errors import ConfigError
from semijax.models import checks
from semijax.models import layers
from semijax.models import llama_layers
from semijax.models import tasks


class Llama(nnx.Module):
  """Decoder-only language model: token embedding, pre-RMSNorm blocks (grouped-query attention
  with rotary embeddings, SwiGLU MLP, no biases), a final RMSNorm and a linear head, optionally
  tied to the embedding.

  Call: tokens int32 [batch, seq] -> logits float32 [batch, seq, vocab_size].
  The "heads" units are KV groups (`llama_layers`): `layout.heads` counts num_kv_heads of them.
  Embedding, norms and the head are replicated over `tensor`; batch is split over `data`. The
  blocks compute in `precision.dtype`; the head's GEMM accumulates into float32 logits.
  """

  input_key = "inputs"
  # The modules `stem` reads, and those `head_out` reads (set per instance: with tied
  # embeddings the head reads the embedding): a drained device skips them (`core.repeated`).
  stem_paths = ("embed",)
  INT_FIELDS = ("vocab_size", "seq_len", "d_model", "num_heads", "num_kv_heads", "d_ff",
                "num_layers")
  FIELDS = INT_FIELDS + ("tie_embeddings",)
  loss_terms = staticmethod(tasks.language_model)

  @classmethod
  def spec(cls, **fields) -> spec_lib.ModelSpec:
    """The validated spec of a Llama with these config fields (ConfigError naming a bad one);
    `tie_embeddings` is optional (default False)."""
    fields = dict(fields)
    tie = fields.pop("tie_embeddings", False)
    if not isinstance(tie, bool):
      raise ConfigError(f"config.model.tie_embeddings: must be True or False, got {tie!r}")
    f = checks.positive_fields("llama", cls.INT_FIELDS, fields)
    checks.heads_divide_width(f)
    if f["num_heads"] % f["num_kv_heads"]:
      raise ConfigError(f"config.model.num_kv_heads: {f['num_kv_heads']} key/value heads must "
                        f"divide num_heads = {f['num_heads']} (1 <= num_kv_heads <= num_heads; "
                        f"each KV group shares its heads with num_heads / num_kv_heads queries)")
    if (f["d_model"] // f["num_heads"]) % 2:
      raise ConfigError(f"config.model.num_heads: head_dim = d_model / num_heads = "
                        f"{f['d_model'] // f['num_heads']} must be even for rotary embeddings")
    f["tie_embeddings"] = tie
    return spec_lib.ModelSpec("llama", tuple((k, f[k]) for k in cls.FIELDS), f["d_model"],
                              f["num_heads"], f["d_ff"], f["num_layers"], seq_len=f["seq_len"],
                              causal=True, items_per_example=f["seq_len"], unit="tokens",
                              num_kv_heads=f["num_kv_heads"], gated_mlp=True, biases=False)

  def __init__(self, *, vocab_size: int = 256, seq_len: int, d_model: int, num_heads: int,
               num_kv_heads: int, d_ff: int, num_layers: int, tie_embeddings: bool = False,
               precision: layers.Precision = layers.Precision(), rngs: nnx.Rngs):
    del seq_len   # rotary embeddings have no table; the spec counts FLOPs with it
    self.precision = precision
    self.tie_embeddings = tie_embeddings
    self.head_paths = ("final_norm", "embed" if tie_embeddings else "head")
    self.embed = nnx.Embed(vocab_size, d_model, dtype=precision.compute,
                           param_dtype=precision.storage, rngs=rngs)
    self.encoder = llama_layers.Encoder(num_layers, d_model, num_heads, num_kv_heads, d_ff,
                                        precision=precision, rngs=rngs)
    if not tie_embeddings:
      self.head = layers.head(d_model, vocab_size, False, precision, rngs)

  def __call__(self, tokens: jnp.ndarray, plan: plan_lib.Plan) -> jnp.ndarray:
    return self.head_out(self.encoder.run_blocks(self.stem(tokens), plan))

  def stem(self, tokens: jnp.ndarray) -> jnp.ndarray:
    """int32 [batch, seq] -> [batch, seq, d_model] (compute dtype): what the first block sees."""
    return self.embed(tokens)

  def head_out(self, x: jnp.ndarray) -> jnp.ndarray:
    """The last block's output [batch, seq, d_model] -> float32 logits [batch, seq, vocab]."""
    x = self.encoder.final_norm(x)
    if not self.tie_embeddings:
      return self.head(x)
    table = layers.read((self.embed.embedding,), self.precision)[0]       # [vocab, d_model]
    return jnp.einsum("...d,vd->...v", x, table, preferred_element_type=jnp.float32)

  def init_cache(self, batch: int, length: int) -> list:
    """Every block's empty key/value cache [batch, length, C, head_dim] (local: C KV groups)."""
    return layers.init_cache(self.encoder.blocks, batch, length)

  def decode(self, tokens: jnp.ndarray, cache: list, pos, plan: plan_lib.Plan):
    """tokens int32 [batch, T] at positions pos .. pos + T - 1, after the tokens whose keys and
    values `cache` holds -> (logits float32 [batch, T, vocab], the cache with theirs too)."""
    x, cache = layers.decode_blocks(self.encoder.blocks, self.stem(tokens), cache, pos, plan)
    return self.head_out(x), cache

  def unit_sizes(self) -> dict:
    """Entries per unit along each unit axis: one hidden unit, one KV group."""
    return {"mlp": 1, "heads": 1}
