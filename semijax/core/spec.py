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


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """A validated model description (layout-independent).

  Attributes:
    name: the registry name ("gpt", "vit").
    fields: ((config field, value), ...): the model constructor's keyword arguments.
    d_model, num_heads, d_ff, num_layers: transformer sizes.
    seq_len: tokens per example the blocks see (bytes for a GPT, patches + class token for a ViT).
    causal: whether attention masks future positions.
    items_per_example: what one example counts in throughput ("tokens": seq_len, "images": 1).
    unit: the throughput unit, "tokens" or "images".
    precision: compute and storage dtypes and the attention kernel (not part of `fields`: a
      checkpoint of one precision restores into another).
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

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads

  @property
  def kwargs(self) -> dict:
    return dict(self.fields)

  def to_dict(self) -> dict:
    """The config fields (with the name), as a checkpoint records them (the precision is not
    among them: it does not change what a checkpoint holds, only its dtypes)."""
    return {"name": self.name, **self.kwargs}

  def num_units(self) -> dict:
    """{kind: U}: MLP hidden units and attention heads."""
    return {"mlp": self.d_ff, "heads": self.num_heads}

  def unit_sizes(self) -> dict:
    """{kind: entries per unit along its unit axis}."""
    return {"mlp": 1, "heads": self.head_dim}

  def flops_per_unit(self) -> dict:
    """Forward FLOPs per token of one unit of each kind.

    mlp: one column of the up-projection and one row of the down-projection (2 * 2 * d_model).
    heads: head_dim columns of Q, K, V and head_dim rows of the output projection
    (2 * 4 * d_model * head_dim), plus the score and value products over the sequence
    (2 * 2 * seq_len * head_dim, halved when causal).
    """
    gemm = self.gemm_flops_per_unit()
    return {"mlp": gemm["mlp"], "heads": gemm["heads"] + self._attention_flops()}

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
    """
    d, f = self.d_model, self.kwargs
    if self.name == "gpt":
      v = f["vocab_size"]
      return {"first": float(d), "last": float(LAYERNORM_FLOPS * d + 2 * d * v + 5 * v)}
    if self.name == "vit":
      patch_in = f["patch_size"] ** 2 * f["channels"]
      head = 2 * d * f["num_classes"] + 5 * f["num_classes"]
      return {"first": float(2 * patch_in * d * (self.seq_len - 1) / self.seq_len + d),
              "last": float(LAYERNORM_FLOPS * d + head / self.seq_len)}
    raise ValueError(f"spec.name: edge FLOPs are known for 'gpt' and 'vit', not {self.name!r}")

  def gemm_flops_per_unit(self) -> dict:
    """The part of `flops_per_unit` in the unit's GEMMs with d_model (what the contraction mode
    of ZERO-resizing shrinks; the attention products over the sequence it does not)."""
    return {"mlp": 4.0 * self.d_model, "heads": 8.0 * self.d_model * self.head_dim}

  def _attention_flops(self) -> float:
    return 2 * 2 * self.seq_len * self.head_dim * (0.5 if self.causal else 1.0)
