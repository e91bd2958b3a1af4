"""Decoding a language model engine's padded parameters with a key/value cache.

`Decoder` runs a model's `decode` under `jax.shard_map` on the engine's mesh: a call reads
tokens [batch, T] at positions pos .. pos + T - 1 and returns their logits and the cache with
their keys and values, so a step that reads one new token costs one token's work, not the
window's. The cache lives on the devices, each holding the keys and values of its own head (or
KV group) slots: [batch, length, N*C, head_dim] per layer and per keys or values, split over
`tensor` like the heads (`core.kv_cache`). Tokens and logits are whole on every device; every
layout, uneven or draining, decodes what the training forward computes.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib
from semijax.core import sharding

# Every cache array: [batch, length, heads, head_dim], the heads split over `tensor`.
CACHE_SPEC = P(None, None, mesh_lib.TENSOR, None)


class CachedModel(Protocol):
  """What a model offers to be decoded with a cache (`models.gpt.GPT`, `models.llama.Llama`);
  both run inside `shard_map` on local blocks."""

  def init_cache(self, batch: int, length: int) -> Any:
    """Every layer's empty cache (local arrays [batch, length, C, head_dim])."""

  def decode(self, tokens: jax.Array, cache: Any, pos: jax.Array,
             plan: plan_lib.Plan) -> tuple[jax.Array, Any]:
    """tokens int32 [batch, T] at positions pos .. pos + T - 1 -> (float32 logits
    [batch, T, vocab], the cache with their keys and values)."""


class Decoder:
  """Cached decoding of one engine's model in one layout (see module doc).

  Args:
    engine: a `core.engine.Engine` whose model is a `CachedModel`.
    plan: the layout's plan (`Engine.plan`); decoding is exact (`Plan.exact`).
    length: the cache's positions: the model's context (seq_len).
    batch: sequences decoded together.
  """

  def __init__(self, engine, plan: plan_lib.Plan, length: int, batch: int = 1):
    self.plan, self.seq_len = plan.exact(), length
    params_specs = sharding.specs(engine.axes)
    graphdef = engine.graphdef

    def init(params):
      return nnx.merge(graphdef, params).init_cache(batch, length)

    def decode(params, tokens, cache, pos, plan):
      return nnx.merge(graphdef, params).decode(tokens, cache, pos, plan)

    self._init = jax.jit(jax.shard_map(init, mesh=engine.mesh, in_specs=(params_specs,),
                                       out_specs=CACHE_SPEC))
    self._decode = jax.jit(jax.shard_map(
        decode, mesh=engine.mesh,
        in_specs=(params_specs, P(), CACHE_SPEC, P(), plan_lib.plan_specs(self.plan)),
        out_specs=(P(), CACHE_SPEC)))

  def init(self, params) -> Any:
    """Every layer's empty cache (keys and values), for padded `params` of the plan's layout."""
    return self._init(params)

  def __call__(self, params, tokens: jax.Array, cache: Any, pos: jax.Array
               ) -> tuple[jax.Array, Any]:
    """(float32 logits [batch, T, vocab] of int32 tokens [batch, T] at positions
    pos .. pos + T - 1 (pos + T <= length), the cache with their keys and values); one
    compiled program per T, also inside another (`models.sampling.generate`'s step)."""
    return self._decode(params, tokens, cache, pos, self.plan)
