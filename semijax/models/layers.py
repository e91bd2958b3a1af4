"""Transformer blocks with uneven heads and MLP units (Megatron pattern), as Flax NNX modules.

The modules are built with *logical* parameter shapes (d_ff hidden units, num_heads heads); the
engine packs them into padded device-major arrays and runs `__call__` inside `jax.shard_map`,
where every parameter is the device's *local* block. So `__call__` reads widths from the arrays,
never from the constructor arguments.

Precision (`core.precision.Precision`): parameters are stored in `param_dtype` and cast to
`dtype` where a block reads them, so activations, GEMMs and the tensor all-reduce of partial sums
run in `dtype`; LayerNorm statistics are float32 (Flax computes them so).

Logical axes (`axes=` metadata): "embed" (d_model), "mlp" (MLP hidden units, split over tensor),
"heads" (head_dim * num_heads, split over tensor by head). Replicated parameters (LayerNorm,
output biases) are computed redundantly on every tensor device, as in Megatron.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from semijax.core import kernels
from semijax.core import kv_cache
from semijax.core import plan as plan_lib
from semijax.core import precision as precision_lib
from semijax.core import remat
from semijax.core import repeated
from semijax.core import tp

Precision = precision_lib.Precision
kernel_init = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()


def param(init, rngs, shape, axes, precision: Precision):
  """A parameter drawn in float32 and stored in `precision.param_dtype` (so a model's values are
  the same draw, rounded, in every storage precision)."""
  return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(precision.storage), axes=axes)


def layer_norm(d_model: int, precision: Precision, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(d_model, dtype=precision.compute, param_dtype=precision.storage,
                       rngs=rngs)


def head(d_model: int, outputs: int, use_bias: bool, precision: Precision,
         rngs: nnx.Rngs) -> nnx.Linear:
  """The output layer: a GEMM in the compute dtype that accumulates into float32 logits."""
  return nnx.Linear(d_model, outputs, use_bias=use_bias, dtype=precision.compute,
                    param_dtype=precision.storage, preferred_element_type=jnp.float32, rngs=rngs)


def read(variables, precision: Precision) -> list:
  """The values of `variables`, cast to the compute dtype."""
  return [precision_lib.cast(v[...], precision.compute) for v in variables]


class MLP(nnx.Module):
  """Column-parallel up-projection, GELU, row-parallel down-projection, one all-reduce.

  Parameters (logical): w1 [d_model, d_ff], b1 [d_ff], w2 [d_ff, d_model], b2 [d_model].
  """

  def __init__(self, d_model: int, d_ff: int, *, precision: Precision = Precision(),
               rngs: nnx.Rngs):
    self.precision = precision
    self.w1 = param(kernel_init, rngs, (d_model, d_ff), ("embed", "mlp"), precision)
    self.b1 = param(zeros, rngs, (d_ff,), ("mlp",), precision)
    self.w2 = param(kernel_init, rngs, (d_ff, d_model), ("mlp", "embed"), precision)
    self.b2 = param(zeros, rngs, (d_model,), ("embed",), precision)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [..., d_model] (compute dtype) replicated over tensor -> the same, replicated."""
    w1, b1, w2, b2 = read((self.w1, self.b1, self.w2, self.b2), self.precision)
    y = tp.row_parallel(plan, "mlp", kernels.mlp_partial, x, w1, b1, w2, units=kernels.MLP_UNITS)
    return y + b2


class Attention(nnx.Module):
  """Multi-head self-attention, heads split over tensor: column-parallel Q/K/V, row-parallel out.

  Parameters (logical): wq, wk, wv [d_model, num_heads*head_dim], bq, bk, bv [num_heads*head_dim],
  wo [num_heads*head_dim, d_model], bo [d_model].
  """

  def __init__(self, d_model: int, num_heads: int, *, causal: bool, precision: Precision,
               rngs: nnx.Rngs):
    self.head_dim = d_model // num_heads
    self.causal = causal
    self.precision = precision
    inner = num_heads * self.head_dim
    for name in ("q", "k", "v"):
      setattr(self, f"w{name}", param(kernel_init, rngs, (d_model, inner), ("embed", "heads"),
                                      precision))
      setattr(self, f"b{name}", param(zeros, rngs, (inner,), ("heads",), precision))
    self.wo = param(kernel_init, rngs, (inner, d_model), ("heads", "embed"), precision)
    self.bo = param(zeros, rngs, (d_model,), ("embed",), precision)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] (compute dtype) replicated over tensor -> same, replicated."""
    fn = functools.partial(kernels.attention_partial, head_dim=self.head_dim, causal=self.causal,
                           implementation=self.precision.attention_impl(self.head_dim),
                           skip_idle=plan.idle)
    *weights, bo = read((self.wq, self.bq, self.wk, self.bk, self.wv, self.bv, self.wo,
                         self.bo), self.precision)
    units = kernels.attention_units(self.head_dim)
    return tp.row_parallel(plan, "heads", fn, x, *weights, units=units) + bo

  def init_cache(self, batch: int, length: int) -> tuple:
    """Empty keys and values [batch, length, C, head_dim] of this device's C head slots."""
    heads = self.wk.shape[1] // self.head_dim
    return kv_cache.empty(batch, length, heads, self.head_dim, self.precision.compute)

  def decode(self, x, cache: tuple, pos):
    """x: [batch, T, d_model] at positions pos .. pos + T - 1 -> (the same shape, replicated;
    the cache with their keys and values), over every head slot (`core.kv_cache`)."""
    *weights, bo = read((self.wq, self.bq, self.wk, self.bk, self.wv, self.bv, self.wo,
                         self.bo), self.precision)
    y, cache = kv_cache.gpt_attention(x, *weights, cache, pos, head_dim=self.head_dim)
    return y + bo, cache


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, d_model: int, num_heads: int, d_ff: int, *, causal: bool,
               precision: Precision = Precision(), rngs: nnx.Rngs):
    self.ln1 = layer_norm(d_model, precision, rngs)
    self.attn = Attention(d_model, num_heads, causal=causal, precision=precision, rngs=rngs)
    self.ln2 = layer_norm(d_model, precision, rngs)
    self.mlp = MLP(d_model, d_ff, precision=precision, rngs=rngs)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] -> the same. A device that owns no unit of a kind skips that
    kind's LayerNorm (`core.repeated.normed`)."""
    x = x + self.attn(repeated.normed(self.ln1, x, plan, "heads"), plan)
    return x + self.mlp(repeated.normed(self.ln2, x, plan, "mlp"), plan)

  def decode(self, x, cache: tuple, pos, plan: plan_lib.Plan):
    """`__call__` of x [batch, T, d_model] at positions pos .. pos + T - 1 with the attention's
    key/value cache: (the same shape, the new cache)."""
    a, cache = self.attn.decode(repeated.normed(self.ln1, x, plan, "heads"), cache, pos)
    x = x + a
    return x + self.mlp(repeated.normed(self.ln2, x, plan, "mlp"), plan), cache


class Encoder(nnx.Module):
  """A stack of blocks followed by a final LayerNorm."""

  def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int, *, causal: bool,
               precision: Precision = Precision(), rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(d_model, num_heads, d_ff, causal=causal, precision=precision,
                                  rngs=rngs) for _ in range(num_layers)])
    self.ln_f = layer_norm(d_model, precision, rngs)
    self.remat_policy = precision.remat_policy   # `core.remat`

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] replicated over tensor; block i gets `plan.layer(i)`."""
    return self.ln_f(self.run_blocks(x, plan))

  def run_blocks(self, x, plan: plan_lib.Plan):
    """The blocks alone (a pipeline stage runs its own share of them, `core.pipeline`)."""
    for i, block in enumerate(self.blocks):
      x = remat.run_block(block, x, plan.layer(i), self.remat_policy)
    return x


def init_cache(blocks, batch: int, length: int) -> list:
  """Each block's empty key/value cache (local, `core.kv_cache`)."""
  return [block.attn.init_cache(batch, length) for block in blocks]


def decode_blocks(blocks, x, cache: list, pos, plan: plan_lib.Plan):
  """The blocks on x [batch, T, d_model] at positions pos .. pos + T - 1, each with its cache:
  (the last block's output, every block's new cache)."""
  out = []
  for i, (block, c) in enumerate(zip(blocks, cache)):
    x, c = block.decode(x, c, pos, plan.layer(i))
    out.append(c)
  return x, out
