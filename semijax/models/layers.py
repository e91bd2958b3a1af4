"""Transformer blocks with uneven heads and MLP units (Megatron pattern), as Flax NNX modules.

The modules are built with *logical* parameter shapes (d_ff hidden units, num_heads heads); the
engine packs them into padded device-major arrays and runs `__call__` inside `jax.shard_map`,
where every parameter is the device's *local* block. So `__call__` reads widths from the arrays,
never from the constructor arguments.

Logical axes (`axes=` metadata): "embed" (d_model), "mlp" (MLP hidden units, split over tensor),
"heads" (head_dim * num_heads, split over tensor by head). Replicated parameters (LayerNorm,
output biases) are computed redundantly on every tensor device, as in Megatron.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from flax import nnx

from semijax.core import kernels
from semijax.core import plan as plan_lib
from semijax.core import tp

kernel_init = nnx.initializers.lecun_normal()
zeros = nnx.initializers.zeros_init()


def _param(init, rngs, shape, axes):
  return nnx.Param(init(rngs.params(), shape, jnp.float32), axes=axes)


class MLP(nnx.Module):
  """Column-parallel up-projection, GELU, row-parallel down-projection, one all-reduce.

  Parameters (logical): w1 [d_model, d_ff], b1 [d_ff], w2 [d_ff, d_model], b2 [d_model].
  """

  def __init__(self, d_model: int, d_ff: int, *, rngs: nnx.Rngs):
    self.w1 = _param(kernel_init, rngs, (d_model, d_ff), ("embed", "mlp"))
    self.b1 = _param(zeros, rngs, (d_ff,), ("mlp",))
    self.w2 = _param(kernel_init, rngs, (d_ff, d_model), ("mlp", "embed"))
    self.b2 = _param(zeros, rngs, (d_model,), ("embed",))

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [..., d_model] replicated over tensor -> [..., d_model] replicated."""
    y = tp.row_parallel(plan, "mlp", kernels.mlp_partial, x, self.w1[...], self.b1[...],
                        self.w2[...], units=kernels.MLP_UNITS)
    return y + self.b2[...]


class Attention(nnx.Module):
  """Multi-head self-attention, heads split over tensor: column-parallel Q/K/V, row-parallel out.

  Parameters (logical): wq, wk, wv [d_model, num_heads*head_dim], bq, bk, bv [num_heads*head_dim],
  wo [num_heads*head_dim, d_model], bo [d_model].
  """

  def __init__(self, d_model: int, num_heads: int, *, causal: bool, rngs: nnx.Rngs):
    self.head_dim = d_model // num_heads
    self.causal = causal
    inner = num_heads * self.head_dim
    for name in ("q", "k", "v"):
      setattr(self, f"w{name}", _param(kernel_init, rngs, (d_model, inner), ("embed", "heads")))
      setattr(self, f"b{name}", _param(zeros, rngs, (inner,), ("heads",)))
    self.wo = _param(kernel_init, rngs, (inner, d_model), ("heads", "embed"))
    self.bo = _param(zeros, rngs, (d_model,), ("embed",))

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] replicated over tensor -> same shape, replicated."""
    fn = functools.partial(kernels.attention_partial, head_dim=self.head_dim, causal=self.causal)
    weights = [v[...] for v in (self.wq, self.bq, self.wk, self.bk, self.wv, self.bv, self.wo)]
    units = kernels.attention_units(self.head_dim)
    return tp.row_parallel(plan, "heads", fn, x, *weights, units=units) + self.bo[...]


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, d_model: int, num_heads: int, d_ff: int, *, causal: bool, rngs: nnx.Rngs):
    self.ln1 = nnx.LayerNorm(d_model, rngs=rngs)
    self.attn = Attention(d_model, num_heads, causal=causal, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d_model, rngs=rngs)
    self.mlp = MLP(d_model, d_ff, rngs=rngs)

  def __call__(self, x, plan: plan_lib.Plan):
    x = x + self.attn(self.ln1(x), plan)
    return x + self.mlp(self.ln2(x), plan)


class Encoder(nnx.Module):
  """A stack of blocks followed by a final LayerNorm."""

  def __init__(self, num_layers: int, d_model: int, num_heads: int, d_ff: int, *, causal: bool,
               rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(d_model, num_heads, d_ff, causal=causal, rngs=rngs)
                            for _ in range(num_layers)])
    self.ln_f = nnx.LayerNorm(d_model, rngs=rngs)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] replicated over tensor; block i gets `plan.layer(i)`."""
    return self.ln_f(self.run_blocks(x, plan))

  def run_blocks(self, x, plan: plan_lib.Plan):
    """The blocks alone (a pipeline stage runs its own share of them, `core.pipeline`)."""
    for i, block in enumerate(self.blocks):
      x = block(x, plan.layer(i))
    return x
