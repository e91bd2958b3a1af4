"""Llama-style blocks with uneven KV groups and MLP units, as Flax NNX modules.

As in `layers` (its module doc has the logical and padded forms and the precision), the modules
are built with logical shapes and run inside `jax.shard_map` on each device's local blocks, so
`__call__` reads widths from the arrays. No parameter has a bias.

Logical axes: "embed" (d_model); "mlp" (SwiGLU hidden units: a column of w_gate and of w_up and
a row of w_down); "heads" (KV groups: one index holds a key head, a value head and the
num_heads / num_kv_heads query heads that share them, `core.kernels_llama`). The group axis is
explicit, so a device owns whole groups.
"""

from __future__ import annotations

import functools

from flax import nnx

from semijax.core import kernels_llama
from semijax.core import kv_cache
from semijax.core import plan as plan_lib
from semijax.core import remat
from semijax.core import repeated
from semijax.core import tp
from semijax.models import layers

Precision = layers.Precision
RMS_EPSILON = 1e-5
# Column blocks [d_model, groups, n] draw with fan-in d_model; row blocks [groups, n, d_model]
# with fan-in groups * n (= d_model): the GPT's scale (`layers.kernel_init`).
column_init = nnx.initializers.lecun_normal(in_axis=0, out_axis=(1, 2))
row_init = nnx.initializers.lecun_normal(in_axis=(0, 1), out_axis=2)


def rms_norm(d_model: int, precision: Precision, rngs: nnx.Rngs) -> nnx.RMSNorm:
  """x * rsqrt(mean(x^2) + eps) * scale, statistics in float32 (Flax computes them so)."""
  return nnx.RMSNorm(d_model, epsilon=RMS_EPSILON, dtype=precision.compute,
                     param_dtype=precision.storage, rngs=rngs)


class SwiGLU(nnx.Module):
  """silu(x @ w_gate) * (x @ w_up) @ w_down: column-parallel gate and up, row-parallel down.

  Parameters (logical): w_gate, w_up [d_model, d_ff], w_down [d_ff, d_model].
  """

  def __init__(self, d_model: int, d_ff: int, *, precision: Precision, rngs: nnx.Rngs):
    self.precision = precision
    for name in ("w_gate", "w_up"):
      setattr(self, name, layers.param(layers.kernel_init, rngs, (d_model, d_ff),
                                       ("embed", "mlp"), precision))
    self.w_down = layers.param(layers.kernel_init, rngs, (d_ff, d_model), ("mlp", "embed"),
                               precision)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [..., d_model] (compute dtype) replicated over tensor -> the same, replicated."""
    weights = layers.read((self.w_gate, self.w_up, self.w_down), self.precision)
    return tp.row_parallel(plan, "mlp", kernels_llama.swiglu_partial, x, *weights,
                           units=kernels_llama.SWIGLU_UNITS)


class GroupedAttention(nnx.Module):
  """Causal grouped-query attention with rotary embeddings, KV groups split over tensor.

  Parameters (logical, G = num_kv_heads, g = num_heads / G, hd = d_model / num_heads):
  wq [d_model, G, g*hd], wk, wv [d_model, G, hd], wo [G, g*hd, d_model].
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, *, precision: Precision,
               rngs: nnx.Rngs):
    self.head_dim = d_model // num_heads
    self.precision = precision
    group = num_heads // num_kv_heads
    col = lambda n: layers.param(column_init, rngs, (d_model, num_kv_heads, n),
                                 ("embed", "heads", None), precision)
    self.wq = col(group * self.head_dim)
    self.wk = col(self.head_dim)
    self.wv = col(self.head_dim)
    self.wo = layers.param(row_init, rngs, (num_kv_heads, group * self.head_dim, d_model),
                           ("heads", None, "embed"), precision)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] (compute dtype) replicated over tensor -> same, replicated."""
    fn = functools.partial(kernels_llama.gqa_partial,
                           implementation=self.precision.attention_impl(self.head_dim),
                           skip_idle=plan.idle)
    weights = layers.read((self.wq, self.wk, self.wv, self.wo), self.precision)
    return tp.row_parallel(plan, "heads", fn, x, *weights, units=kernels_llama.GQA_UNITS)

  def init_cache(self, batch: int, length: int) -> tuple:
    """Empty keys and values [batch, length, C, head_dim] of this device's C KV group slots."""
    return kv_cache.empty(batch, length, self.wk.shape[1], self.head_dim,
                          self.precision.compute)

  def decode(self, x, cache: tuple, pos):
    """x: [batch, T, d_model] at positions pos .. pos + T - 1 -> (the same shape, replicated;
    the cache with their keys and values), over every group slot (`core.kv_cache`)."""
    weights = layers.read((self.wq, self.wk, self.wv, self.wo), self.precision)
    return kv_cache.grouped_attention(x, *weights, cache, pos)


class Block(nnx.Module):
  """Pre-RMSNorm block: x + attn(norm(x)), then x + mlp(norm(x)). A device that owns no unit of
  a kind skips that kind's norm (`core.repeated.normed`)."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, d_ff: int, *,
               precision: Precision, rngs: nnx.Rngs):
    self.attn_norm = rms_norm(d_model, precision, rngs)
    self.attn = GroupedAttention(d_model, num_heads, num_kv_heads, precision=precision,
                                 rngs=rngs)
    self.mlp_norm = rms_norm(d_model, precision, rngs)
    self.mlp = SwiGLU(d_model, d_ff, precision=precision, rngs=rngs)

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] -> the same."""
    x = x + self.attn(repeated.normed(self.attn_norm, x, plan, "heads"), plan)
    return x + self.mlp(repeated.normed(self.mlp_norm, x, plan, "mlp"), plan)

  def decode(self, x, cache: tuple, pos, plan: plan_lib.Plan):
    """`__call__` with the attention's key/value cache (as `layers.Block.decode`)."""
    a, cache = self.attn.decode(repeated.normed(self.attn_norm, x, plan, "heads"), cache, pos)
    x = x + a
    return x + self.mlp(repeated.normed(self.mlp_norm, x, plan, "mlp"), plan), cache


class Encoder(nnx.Module):
  """A stack of blocks followed by a final RMSNorm (`final_norm`)."""

  def __init__(self, num_layers: int, d_model: int, num_heads: int, num_kv_heads: int,
               d_ff: int, *, precision: Precision, rngs: nnx.Rngs):
    self.blocks = nnx.List([Block(d_model, num_heads, num_kv_heads, d_ff, precision=precision,
                                  rngs=rngs) for _ in range(num_layers)])
    self.final_norm = rms_norm(d_model, precision, rngs)
    self.remat_policy = precision.remat_policy   # `core.remat`

  def __call__(self, x, plan: plan_lib.Plan):
    """x: [batch, seq, d_model] replicated over tensor; block i gets `plan.layer(i)`."""
    return self.final_norm(self.run_blocks(x, plan))

  def run_blocks(self, x, plan: plan_lib.Plan):
    """The blocks alone (a pipeline stage runs its own share of them, `core.pipeline`)."""
    for i, block in enumerate(self.blocks):
      x = remat.run_block(block, x, plan.layer(i), self.remat_policy)
    return x
