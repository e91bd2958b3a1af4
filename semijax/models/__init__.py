"""Models built from uneven tensor-parallel blocks, and how a config names them."""

from __future__ import annotations

from semijax.models import gpt
from semijax.models import tasks
from semijax.models import vit

# config.model fields of each model (besides `name`); all are required.
FIELDS = {
    "gpt": ("vocab_size", "seq_len", "d_model", "num_heads", "d_ff", "num_layers"),
    "vit": ("image_size", "patch_size", "channels", "num_classes", "d_model", "num_heads", "d_ff",
            "num_layers"),
}
_CLASSES = {"gpt": (gpt.GPT, tasks.language_model), "vit": (vit.ViT, tasks.classification)}


def build(model_cfg):
  """(model_fn(rngs) -> nnx.Module, loss_terms) for `config.model`."""
  cls, loss_terms = _CLASSES[model_cfg.name]
  kw = {k: model_cfg[k] for k in FIELDS[model_cfg.name]}
  return (lambda rngs: cls(rngs=rngs, **kw)), loss_terms


def sequence_length(model_cfg) -> int:
  """Tokens per example the blocks see (bytes for GPT, patches + class token for ViT)."""
  if model_cfg.name == "gpt":
    return model_cfg.seq_len
  return (model_cfg.image_size // model_cfg.patch_size) ** 2 + 1


def is_causal(model_cfg) -> bool:
  return model_cfg.name == "gpt"
