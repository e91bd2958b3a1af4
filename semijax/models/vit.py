"""A Vision Transformer with uneven tensor-parallel heads and MLP units."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from semijax.core import plan as plan_lib
from semijax.models import layers


def patchify(images: jnp.ndarray, patch: int) -> jnp.ndarray:
  """[batch, H, W, C] -> [batch, (H/patch)*(W/patch), patch*patch*C], rows of patches in order."""
  b, h, w, c = images.shape
  x = images.reshape(b, h // patch, patch, w // patch, patch, c)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(b, (h // patch) * (w // patch), patch * patch * c)


class ViT(nnx.Module):
  """Patch embedding, class token, learned positions, bidirectional blocks, linear classifier.

  Call: images float32 [batch, H, W, C] -> logits float32 [batch, num_classes].
  """

  input_key = "images"

  def __init__(self, *, image_size: int, patch_size: int, channels: int, num_classes: int,
               d_model: int, num_heads: int, d_ff: int, num_layers: int, rngs: nnx.Rngs):
    if image_size % patch_size:
      raise ValueError(f"model.patch_size: {patch_size} does not divide image_size {image_size}")
    self.head_dim = d_model // num_heads
    self.patch_size = patch_size
    num_patches = (image_size // patch_size) ** 2
    self.patch = nnx.Linear(patch_size * patch_size * channels, d_model, rngs=rngs)
    self.cls = nnx.Param(jnp.zeros((1, 1, d_model)), axes=(None, None, "embed"))
    self.pos = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (num_patches + 1, d_model)),
                         axes=(None, "embed"))
    self.encoder = layers.Encoder(num_layers, d_model, num_heads, d_ff, causal=False, rngs=rngs)
    self.head = nnx.Linear(d_model, num_classes, rngs=rngs)

  def __call__(self, images: jnp.ndarray, plan: plan_lib.Plan) -> jnp.ndarray:
    x = self.patch(patchify(images, self.patch_size))
    cls = jnp.broadcast_to(self.cls[...], (x.shape[0], 1, x.shape[-1]))
    x = jnp.concatenate([cls, x], axis=1) + self.pos[...]
    return self.head(self.encoder(x, plan)[:, 0])

  def unit_sizes(self) -> dict:
    return {"mlp": 1, "heads": self.head_dim}
