"""A Vision Transformer with uneven tensor-parallel heads and MLP units."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from semijax.core import plan as plan_lib
from semijax.core import spec as spec_lib
from semijax.errors import ConfigError
from semijax.models import checks
from semijax.models import layers
from semijax.models import tasks


def patchify(images: jnp.ndarray, patch: int) -> jnp.ndarray:
  """[batch, H, W, C] -> [batch, (H/patch)*(W/patch), patch*patch*C], rows of patches in order."""
  b, h, w, c = images.shape
  x = images.reshape(b, h // patch, patch, w // patch, patch, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViT(nnx.Module):
  """Patch embedding, class token, learned positions, bidirectional blocks, linear classifier.

  Call: images float32 [batch, H, W, C] -> logits float32 [batch, num_classes]; the blocks
  compute in `precision.dtype`.
  """

  input_key = "images"
  # The modules `stem` and `head_out` read: a drained device skips them (`core.repeated`).
  stem_paths = ("patch", "cls", "pos")
  head_paths = ("ln_f", "head")
  FIELDS = ("image_size", "patch_size", "channels", "num_classes", "d_model", "num_heads", "d_ff",
            "num_layers")
  loss_terms = staticmethod(tasks.classification)

  @classmethod
  def spec(cls, **fields) -> spec_lib.ModelSpec:
    """The validated spec of a ViT with these config fields (ConfigError naming a bad one)."""
    f = checks.positive_fields("vit", cls.FIELDS, fields)
    checks.heads_divide_width(f)
    if f["image_size"] % f["patch_size"]:
      raise ConfigError(f"config.model.patch_size: {f['patch_size']} does not divide "
                        f"config.model.image_size {f['image_size']}; use a divisor of it")
    seq_len = (f["image_size"] // f["patch_size"]) ** 2 + 1     # patches + the class token
    return spec_lib.ModelSpec("vit", tuple((k, f[k]) for k in cls.FIELDS), f["d_model"],
                              f["num_heads"], f["d_ff"], f["num_layers"], seq_len=seq_len,
                              causal=False, items_per_example=1, unit="images")

  def __init__(self, *, image_size: int, patch_size: int, channels: int, num_classes: int,
               d_model: int, num_heads: int, d_ff: int, num_layers: int,
               precision: layers.Precision = layers.Precision(), rngs: nnx.Rngs):
    if image_size % patch_size:
      raise ConfigError(f"config.model.patch_size: {patch_size} does not divide "
                        f"config.model.image_size {image_size}")
    self.head_dim = d_model // num_heads
    self.patch_size = patch_size
    num_patches = (image_size // patch_size) ** 2
    self.precision = precision
    self.patch = nnx.Linear(patch_size * patch_size * channels, d_model, dtype=precision.compute,
                            param_dtype=precision.storage, rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, d_model), precision.storage), axes=(None, None, "embed"))
    self.pos = layers.param(nnx.initializers.normal(0.02), rngs, (num_patches + 1, d_model),
                            (None, "embed"), precision)
    self.encoder = layers.Encoder(num_layers, d_model, num_heads, d_ff, causal=False,
                                  precision=precision, rngs=rngs)
    self.head = layers.head(d_model, num_classes, True, precision, rngs)

  def __call__(self, images: jnp.ndarray, plan: plan_lib.Plan) -> jnp.ndarray:
    return self.head_out(self.encoder.run_blocks(self.stem(images), plan))

  def stem(self, images: jnp.ndarray) -> jnp.ndarray:
    """[batch, H, W, C] -> [batch, patches + 1, d_model]: what the first block sees."""
    x = self.patch(patchify(images, self.patch_size))
    cls, pos = layers.read((self.cls, self.pos), self.precision)
    cls = jnp.broadcast_to(cls, (x.shape[0], 1, x.shape[-1]))
    return jnp.concatenate([cls, x], axis=1) + pos

  def head_out(self, x: jnp.ndarray) -> jnp.ndarray:
    """The last block's output [batch, patches + 1, d_model] -> logits [batch, num_classes]."""
    return self.head(self.encoder.ln_f(x)[:, 0])

  def unit_sizes(self) -> dict:
    return {"mlp": 1, "heads": self.head_dim}
