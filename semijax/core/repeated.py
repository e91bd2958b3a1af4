"""The work every tensor device repeats, which a drained device skips.

Outside the split work of the blocks, tensor parallelism repeats the model's unsplit work on
every device of a tensor group: the embedding, each block's norms, the final norm, the head GEMM
over the vocabulary or the classes, and the loss (`core.spec.ModelSpec.edge_flops`). A device
that owns no unit of any kind (a drained device, `core.layout.Layout.drained`) has no use for
it. Under a plan in which a device may own nothing (`drains`; static: `Plan.idle`, so a step in
which every device owns units of every kind has no conds), each piece runs in a `lax.cond`
(`mesh.cond_or_zeros`) whose other branch returns zeros, so a drained device at 1% speed no
longer holds the step for it:

  * `stem`: the embedding, on busy devices only;
  * `normed`: a block's norm, on the devices that own units of the kind that reads it (a device
    with no heads skips the attention's norm even if it owns MLP units);
  * `head_terms`: the final norm, the head and the loss, on busy devices only.

Exact: the loss terms every device returns are those of the lowest-indexed busy device (the
*leader*), summed with zeros over `tensor`. The other busy devices compute the same head; only
the leader's reaches the loss. A drained device's residual stream (zeros plus the blocks'
all-reduced outputs) reaches nothing, and its gradients are zeros: every gradient, summed over
`tensor` (the transpose of using an invariant value on varying devices), is the same value as
under a plan that cannot drain, up to the order of the float additions.

What a drained device still computes: each block's residual and bias adds (elementwise, on the
activations it receives from the all-reduces, which it takes part in with zeros) and, outside
the sharded computation, the optimizer's update of the replicated parameters (elementwise; the
update runs on global arrays, so every copy of a replicated parameter stays equal). The emulated
slowdown charges it neither (`core.emulation.Emulator`).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from semijax.core import mesh as mesh_lib
from semijax.core.plan import Plan


def drains(plan: Plan) -> bool:
  """Static: whether a device may own nothing under `plan`: some device owns no unit of some
  kind (`Plan.idle`) and every kind compiles the width 0, without offload (whose helpers
  compute units they do not own)."""
  return plan.offload is None and plan.idle and all(0 in w for _, w in plan.widths)


def busy(plan: Plan) -> jax.Array:
  """Inside shard_map: bool [] (varying over `tensor`), whether this device owns any unit."""
  return sum(jnp.sum(a) for a in plan.active.values()) > 0


def stem(fn: Callable, inputs, params, plan: Plan):
  """`fn(inputs, params)`: the embedding of the batch's `inputs` with the stem's parameters
  `params` (replicated), skipped by drained devices under a plan that `drains` (zeros there:
  a drained device's residual stream reaches nothing, `head_terms` skips it).

  Returns [batch, seq, d_model] in the compute dtype; under a plan that drains, varying over
  `tensor` (each busy device holds the same values).
  """
  if not drains(plan):
    return fn(inputs, params)
  return mesh_lib.cond_or_zeros(busy(plan), fn, inputs, params)


def normed(norm, x: jax.Array, plan: Plan, kind: str) -> jax.Array:
  """`norm(x)` for the block of `kind` ("heads" or "mlp") that reads it: under a plan in which
  some device owns no unit of some kind (`Plan.idle`, static) and `kind` compiles the width 0
  (without offload), a device that owns none skips the norm, since its partial block of width
  0 never reads its input.

  Args:
    norm: an NNX module (a LayerNorm or an RMSNorm) replicated over `tensor`.
    x: [batch, seq, d_model], the residual stream.
    plan: the layer's local plan (`Plan.layer`).

  Returns `norm(x)`; zeros on the devices that skip it (varying over `tensor` then).
  """
  if plan.offload is not None or not plan.idle or 0 not in plan.widths_of(kind):
    return norm(x)
  graphdef, state = nnx.split(norm)
  return mesh_lib.cond_or_zeros(plan.active[kind][0] > 0,
                                lambda x, s: nnx.merge(graphdef, s)(x), x, state)


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
  out = mesh_lib.cond_or_zeros(here, fn, x, params)
  index = jax.lax.axis_index(mesh_lib.TENSOR)
  size = jax.lax.axis_size(mesh_lib.TENSOR)
  leader = jax.lax.pmin(jnp.where(here, index, size), mesh_lib.TENSOR)
  return jax.tree.map(lambda t: jax.lax.psum(jnp.where(index == leader, t, jnp.zeros_like(t)),
                                             mesh_lib.TENSOR), out)
