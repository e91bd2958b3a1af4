"""A pipelined step's batch (`arrange`): the global batch cut into microbatches, each
data-parallel pipeline's share padded to the same number with zero-weight rows, placed split over
`data`. `core.pipeline` has the design (see its module doc).
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding

WEIGHTS = "weights"


def target_key(batch) -> str:
  """The batch's target entry: "targets" (language models) or "labels"."""
  return "targets" if "targets" in batch else "labels"


def arrange(batch: dict, microbatches: Sequence[int], *, most: int,
            batch_sharding: NamedSharding) -> dict:
  """Host arrays of the global batch (sum(microbatches) * microbatch rows, in order) -> arrays
  [data * M * microbatch, ...] placed with `batch_sharding` (split over `data`): replica d gets
  its `microbatches[d]` microbatches, the rest zeros with weight 0 (M = `most`)."""
  rows = len(next(iter(batch.values())))
  total = sum(microbatches)
  if rows % total:
    raise ValueError(f"pipeline.microbatches: {rows} examples do not split into "
                     f"{total} microbatches of one size")
  mb = rows // total
  weights_key = WEIGHTS
  target = target_key(batch)
  out = {k: [] for k in batch}
  weights = []
  start = 0
  for m in microbatches:
    take = slice(start, start + m * mb)
    pad = (most - m) * mb
    for k, x in batch.items():
      x = np.asarray(x)
      out[k].append(np.concatenate([x[take], np.zeros((pad,) + x.shape[1:], x.dtype)]))
    w = (np.asarray(batch[weights_key], np.float32)[take] if weights_key in batch
         else np.ones(np.asarray(batch[target])[take].shape, np.float32))
    weights.append(np.concatenate([w, np.zeros((pad,) + w.shape[1:], np.float32)]))
    start += m * mb
  arranged = {k: np.concatenate(v) for k, v in out.items()}
  arranged[weights_key] = np.concatenate(weights)
  # Every process holds the whole arranged batch and places the rows its devices hold.
  return jax.tree.map(lambda x: jax.make_array_from_callback(
      x.shape, batch_sharding, lambda index, x=x: x[index]), arranged)
