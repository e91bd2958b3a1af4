"""The work every tensor device repeats, which a drained device skips.

Outside the blocks, tensor parallelism repeats the model's unsplit work on every device of a
tensor group: the final LayerNorm, the head GEMM over the vocabulary or the classes, and the
loss (`core.spec.ModelSpec.edge_flops`'s "last" part, the largest repeated work). A device that
owns no unit of any kind (a drained device, `core.layout.Layout.drained`) has no use for it: under
a plan that may drain (`drains`), `head_terms` runs it in a `lax.cond` whose other branch returns
zeros, so a drained device at 1% speed no longer holds the step for it.

Exact: the loss terms every device returns are those of the lowest-indexed busy device (the
*leader*), summed with zeros over `tensor`. The other busy devices compute the same head; only
the leader's reaches the loss, so the gradients of the head's parameters and of the last block's
output, summed over `tensor` (the transpose of using an invariant value on varying devices), are
the leader's alone: the same values as a plan that cannot drain, added to zeros.

What a drained device still computes: the embedding (a table lookup), each block's LayerNorms and
residual adds (elementwise, on activations it receives from the all-reduces), and, outside the
sharded computation, the optimizer's update of the replicated parameters (elementwise). The
emulated slowdown charges it the embedding only (`core.emulation.Emulator`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from semijax.core import mesh as mesh_lib
from semijax.core.plan import Plan


def drains(plan: Plan) -> bool:
  """Static: whether a device may own nothing under `plan`: every kind compiles the width 0,
  without offload (whose helpers compute units they do not own)."""
  return plan.offload is None and all(0 in w for _, w in plan.widths)


def busy(plan: Plan) -> jax.Array:
  """Inside shard_map: bool [] (varying over `tensor`), whether this device owns any unit."""
  return sum(jnp.sum(a) for a in plan.active.values()) > 0


def head_terms(fn: Callable, x: jax.Array, params, plan: Plan):
  """`fn(x, params)`: the head and the loss terms of the last block's output `x`
  [batch, seq, d_model] (replicated over `tensor`) with the head's parameters `params` (a pytree,
  replicated), skipped by drained devices under a plan that `drains`. `fn` may close over
  anything it does not differentiate (the batch), but must read every parameter it
  differentiates from `params`.

  Returns the pytree `fn` returns, invariant over `tensor`: the leader's (see module doc).
  """
  if not drains(plan):
    return fn(x, params)
  here = busy(plan)
  # The differentiable inputs enter the cond as operands cast outside it (`mesh.vary_alike`).
  x, params = mesh_lib.vary_alike((x, params), (mesh_lib.TENSOR,))
  axes = (mesh_lib.DATA, mesh_lib.TENSOR)
  run = lambda x, p: jax.tree.map(lambda t: mesh_lib.vary(t, axes), fn(x, p))
  zeros = lambda x, p: jax.tree.map(lambda s: mesh_lib.vary(jnp.zeros(s.shape, s.dtype), axes),
                                    jax.eval_shape(fn, x, p))
  out = jax.lax.cond(here, run, zeros, x, params)
  index = jax.lax.axis_index(mesh_lib.TENSOR)
  size = jax.lax.axis_size(mesh_lib.TENSOR)
  leader = jax.lax.pmin(jnp.where(here, index, size), mesh_lib.TENSOR)
  return jax.tree.map(lambda t: jax.lax.psum(jnp.where(index == leader, t, jnp.zeros_like(t)),
                                             mesh_lib.TENSOR), out)
