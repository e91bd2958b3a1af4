"""What the engine, the cost model and the emulation need to know of a model, in one typed value.

Each model (`semijax.models`) builds its own `ModelSpec` from its config fields: the transformer
sizes, the tokens per example its blocks see, whether attention is causal, the entries per unit
along each unit axis and the FLOPs per unit. FLOPs are counted in one place (`flops_per_unit`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from semijax.core import precision as precision_lib

# A LayerNorm's forward FLOPs per token and feature (mean, variance, normalize, scale, shift).
LAYERNORM_FLOPS = 8
# An RMSNorm's (square, mean, add eps and rsqrt, normalize, scale).
RMSNORM_FLOPS = 4


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A validated model description (layout-independent).

  Attributes:
    name: the registry name ("gpt", "vit", "llama").
    fields: ((config field, value), ...): the model constructor's keyword arguments.
    d_model, num_heads (query heads), d_ff, num_layers: transformer sizes.
    seq_len: tokens per example the blocks see (bytes for a GPT, patches + class token for a ViT).
    causal: whether attention masks future positions.
    items_per_example: what one example counts in throughput ("tokens": seq_len, "images": 1).
    unit: the throughput unit, "tokens" or "images".
    precision: compute and storage dtypes and the attention kernel (not part of `fields`: a
      checkpoint of one precision restores into another).
    num_kv_heads: 0 for multi-head attention with a flat head axis, where a "heads" unit is one
      head of head_dim entries (gpt, vit); else grouped-query attention with num_kv_heads key and
      value heads, where a "heads" unit is one KV group (its key and value heads and the
      num_heads / num_kv_heads query heads that share them) on an explicit group axis, one entry
      per unit (llama).
    gated_mlp: an MLP unit has a column of two up projections (gate and up, SwiGLU), not one.
    biases: whether the blocks' projections have biases.
  """

  name: str
  fields: tuple[tuple[str, Any], ...]
  d_model: int
  num_heads: int
  d_ff: int
  num_layers: int
  seq_len: int
  causal: bool
  items_per_example: int
  unit: str
  precision: precision_lib.Precision = precision_lib.Precision()
  num_kv_heads: int = 0
  gated_mlp: bool = False
  biases: bool = True

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def kv_heads(self) -> int:
    """Key and value heads: the "heads" units."""
    return self.num_kv_heads or self.num_heads

  @property
  def group(self) -> int:
    """Query heads per key and value head (1 without grouped-query attention)."""
    return self.num_heads // self.kv_heads

  @property
  def kwargs(self) -> dict:
    return dict(self.fields)

  def to_dict(self) -> dict:
    """The config fields (with the name), as a checkpoint records them (the precision is not
    among them: it does not change what a checkpoint holds, only its dtypes)."""
    return {"name": self.name, **self.kwargs}

  def num_units(self) -> dict:
    """{kind: U}: MLP hidden units and attention heads (KV groups with grouped-query attention)."""
    return {"mlp": self.d_ff, "heads": self.kv_heads}

  def unit_sizes(self) -> dict:
    """{kind: entries per unit along its unit axis}."""
    return {"mlp": 1, "heads": 1 if self.num_kv_heads else self.head_dim}

  def unit_params(self) -> dict:
    """{kind: parameters of one unit in one layer}: an MLP unit's column of each up projection
    (and its bias) and row of the down projection; a heads unit's columns of Q (group * head_dim),
    K and V (head_dim each), their biases, and its group * head_dim rows of the output
    projection."""
    d, hd, g = self.d_model, self.head_dim, self.group
    bias = 1 if self.biases else 0
    ups = 2 if self.gated_mlp else 1
    return {"mlp": (ups + 1) * d + ups * bias, "heads": 2 * (g + 1) * d * hd + bias * (g + 2) * hd}

  def flops_per_unit(self) -> dict:
    """Forward FLOPs per token of one unit of each kind.

    mlp: one column of the up-projection and one row of the down-projection (2 * 2 * d_model;
    2 * 3 * d_model with a gate).
    heads: head_dim columns of Q, K, V and head_dim rows of the output projection
    (2 * 4 * d_model * head_dim), plus the score and value products over the sequence
    (2 * 2 * seq_len * head_dim, halved when causal). A KV group of g query heads: g * head_dim
    columns of Q and rows of the output, head_dim of K and of V (2 * 2 * (g + 1) * d_model *
    head_dim), and g heads' products over the sequence.
    """
    gemm = self.gemm_flops_per_unit()
    return {"mlp": gemm["mlp"], "heads": gemm["heads"] + self.group * self._attention_flops()}

  def edge_flops(self) -> dict:
    """Forward FLOPs per token of the unsplit work outside the blocks, which every device of
    the first and of the last pipeline stage runs whole: {"first": the embedding, "last": the
    final LayerNorm, the head and the loss}.

    gpt: a table lookup and the position add (d_model) first; the final norm, the head GEMM
    over the vocabulary (2 * d_model * vocab_size) and the softmax cross-entropy (5 * vocab)
    last. vit: the patch projection (2 * patch^2 * channels * d_model per patch token) first;
    plus the class token and position add (d_model) first; the final norm over every token, and
    the head on the class token alone (2 * d_model * classes per example, spread over its
    seq_len tokens) last.
    llama: the lookup alone (no FLOPs) first; the final RMSNorm (RMSNORM_FLOPS per feature),
    the head and the loss last.
    """
    d, f = self.d_model, self.kwargs
    if self.name == "llama":
      v = f["vocab_size"]
      return {"first": 0.0, "last": float(RMSNORM_FLOPS * d + 2 * d * v + 5 * v)}
    if self.name == "gpt":
      v = f["vocab_size"]
      return {"first": float(d), "last": float(LAYERNORM_FLOPS * d + 2 * d * v + 5 * v)}
    if self.name == "vit":
      patch_in = f["patch_size"] ** 2 * f["channels"]
      head = 2 * d * f["num_classes"] + 5 * f["num_classes"]
      return {"first": float(2 * patch_in * d * (self.seq_len - 1) / self.seq_len + d),
              "last": float(LAYERNORM_FLOPS * d + head / self.seq_len)}
    raise ValueError(f"spec.name: edge FLOPs are known for 'gpt', 'vit' and 'llama', not "
                     f"{self.name!r}")

  def gemm_flops_per_unit(self) -> dict:
    """The part of `flops_per_unit` in the unit's GEMMs with d_model (what the contraction mode
    of ZERO-resizing shrinks; the attention products over the sequence it does not)."""
    ups = 2 if self.gated_mlp else 1
    return {"mlp": 2.0 * (ups + 1) * self.d_model,
            "heads": 4.0 * (self.group + 1) * self.d_model * self.head_dim}

  def _attention_flops(self) -> float:
    return 2 * 2 * self.seq_len * self.head_dim * (0.5 if self.causal else 1.0)
