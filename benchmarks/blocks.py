"""Timing one transformer block on one device (shared by the micro-benchmarks in experiments/)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from semijax.core import plan as plan_lib
from semijax.core import sharding


def block_step(mesh, block, x):
  """A jitted forward+backward of `block` (one layer: plan.layer(0)) on a 1x1 mesh.

  Args:
    mesh: a (data=1, tensor=1) mesh.
    block: a `layers.Block`.
    x: [batch, seq, d_model] input in the block's compute dtype (global = local).

  Returns:
    (fn(params, x, plan) -> (loss, grads), params).
  """
  graphdef, state = nnx.split(block)
  axes = sharding.axes_tree(state)
  params = jax.device_put(nnx.to_pure_dict(state))
  def loss(p, x, plan):
    def local(p, x, plan):
      return jnp.sum(nnx.merge(graphdef, p)(x, plan.layer(0)).astype(jnp.float32) ** 2)
    in_specs = (sharding.specs(axes), P(), plan_lib.plan_specs(plan))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=P())(p, x, plan)
  return jax.jit(jax.value_and_grad(loss)), params


def median_ms(fn, *args, repeats: int = 30) -> float:
  """Median wall time of fn(*args) in milliseconds, after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t)
  return 1e3 * float(np.median(times))
