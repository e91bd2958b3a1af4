"""Loss terms per task, computed on the local batch shard.

Each function returns *sums* over the local examples ({"loss_sum", "count", "correct"}), so the
engine can all-reduce them over `data` and divide once: the loss is the mean over the global batch
whatever the data-parallel split.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _terms(logits, labels, weights):
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
  hit = (jnp.argmax(logits, axis=-1) == labels).astype(jnp.float32)
  return {"loss_sum": jnp.sum(nll * weights), "count": jnp.sum(weights),
          "correct": jnp.sum(hit * weights)}


def language_model(logits, batch):
  """logits [batch, seq, vocab]; batch["targets"] int32 [batch, seq], optional "weights"."""
  weights = batch.get("weights", jnp.ones(batch["targets"].shape, jnp.float32))
  return _terms(logits, batch["targets"], weights)


def classification(logits, batch):
  """logits [batch, classes]; batch["labels"] int32 [batch], optional "weights"."""
  weights = batch.get("weights", jnp.ones(batch["labels"].shape, jnp.float32))
  return _terms(logits, batch["labels"], weights)
