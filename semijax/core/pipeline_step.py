"""The per-device body of a pipelined step (`PipeStep`, run inside `jax.shard_map`): a schedule's
tick table, each tick at most one forward and one backward per stage, the stage's layer slots
under `lax.scan` / `lax.cond`, activations and cotangents carried over `pipe`, and the sums over
`pipe` and `data` after the last tick. `core.pipeline` has the design (see its module doc).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from semijax.core import mesh as mesh_lib
from semijax.core import pipeline_model
from semijax.core import plan as plan_lib
from semijax.core import remat
from semijax.core import schedule as schedule_lib

DATA, PIPE, TENSOR = mesh_lib.DATA, mesh_lib.PIPE, mesh_lib.TENSOR
SHARED, STACK = pipeline_model.SHARED, pipeline_model.STACK


def _invariant_over_tensor(x):
  """`x`, equal on every tensor device, typed as such (pmax is exact on equal values)."""
  return jax.lax.pmax(x, TENSOR) if TENSOR in mesh_lib.varying_axes(x) else x


class PipeStep:
  """The tick loop of one model's pipelined step on a mesh of `stages` stages.

  Args:
    model: the model's parts (`pipeline_model.PipeModel`).
    loss_terms: (logits, batch) -> {"loss_sum", "count", "correct"} local sums (`models.tasks`).
    stages: P, the mesh's `pipe` size.
    schedule: "gpipe" or "1f1b" (`core.schedule`).
    microbatches: M, the most microbatches any data-parallel pipeline runs in a step (static).
    kernel: how a device computes its width of a block (`Plan.kernel`).
  """

  def __init__(self, model: pipeline_model.PipeModel, loss_terms: Callable, *, stages: int,
               schedule: str, microbatches: int, kernel: str = "auto"):
    self.model, self.loss_terms, self.kernel = model, loss_terms, kernel
    self.stages, self.schedule, self.microbatches = stages, schedule, microbatches

  def _stage(self, stack, count, plan, x):
    """Runs this stage's layer slots on x [mb, seq, d_model]; slots >= count are skipped. (A
    backward tick reruns the stage's forward pass from its input; `remat_policy` says what
    that pass keeps of each block, `core.remat`.)"""
    def body(x, item):
      params, slot = item
      block = nnx.merge(self.model.block_graphdef, params)
      run = lambda x: remat.run_block(block, x, plan, self.model.remat_policy)
      return jax.lax.cond(slot < count, run, lambda x: x, x), None
    slots = jnp.arange(jax.tree.leaves(stack)[0].shape[0])
    x, _ = jax.lax.scan(body, x, (stack, slots))
    return x

  def local(self, params, batch, pplan, scale=None, *, train: bool, per_replica: bool = False):
    """The per-device body (inside shard_map): the tick loop (see module doc).

    scale: float32 [] (replicated), the loss scale (`core.loss_scale`) the backward pass seeds
    the loss with, so that the gradients come back times it; None: 1.
    per_replica: `params` are stacked [1, *local] (this data replica's own copy), `scale` [1]
    its own scale, the loss is normalized by this pipeline's own tokens and nothing is summed
    over `data`: gradients come back [1, *local] and terms [1] (`replica_grads_and_terms`)."""
    if per_replica:
      params = jax.tree.map(lambda x: x[0], params)
      scale = None if scale is None else scale[0]
    s = jax.lax.axis_index(PIPE)
    is_first, is_last = s == 0, s == self.stages - 1
    m_count = self.microbatches
    mbs = jax.tree.map(lambda x: x.reshape((m_count, -1) + x.shape[1:]), batch)
    over_data = (lambda x: x) if per_replica else (lambda x: jax.lax.psum(x, DATA))
    total = over_data(jnp.sum(batch["weights"]))
    plan = plan_lib.Plan({k: v.reshape(1) for k, v in pplan.active.items()}, pplan.widths,
                         kernel=self.kernel)
    if plan.may_idle:   # a stage's devices may own nothing wherever its bucket compiles width 0
      plan = plan.with_idle()
    count = pplan.layers.reshape(())
    table = jnp.take(pplan.table[0], s, axis=1)                         # [T, 2]
    shared = jax.tree.map(lambda x: mesh_lib.vary(x, (DATA, PIPE)), params[SHARED])
    stack = jax.tree.map(lambda x: mesh_lib.vary(x, (DATA,)), params[STACK])
    pick = lambda m: jax.tree.map(lambda x: x[jnp.maximum(m, 0)], mbs)

    def zero_terms(ref):
      z = jnp.zeros_like(ref[(0,) * ref.ndim], jnp.float32)
      return {"loss_sum": z, "count": z, "correct": z}

    def g(shared, stack, x_in, mb):
      """(stage output, loss terms): the embedding first, the stage's layers, the head last."""
      model = self.model.shared_model(shared)
      x0 = jax.lax.cond(is_first, lambda: model.stem(mb[self.model.input_key]).astype(x_in.dtype),
                        lambda: x_in)
      h = self._stage(stack, count, plan, x0)
      terms = jax.lax.cond(is_last, lambda: self.loss_terms(model.head_out(h), mb),
                           lambda: zero_terms(h))
      return h, terms

    stem = self.model.shared_model(shared).stem
    probe = mesh_lib.vary(jnp.zeros_like(stem(pick(0)[self.model.input_key])), (DATA, PIPE))
    # Stash slots: the most microbatches a stage holds between ticks (at least the one a
    # single stage's backward reads in its forward's tick).
    slots = max(1, int(schedule_lib.in_flight(np.asarray(schedule_lib.table(
        self.schedule, self.stages, m_count))).max())) if train else 1
    zeros_grads = lambda t: jax.tree.map(jnp.zeros_like, t)
    carry = {"x": probe, "g": probe, "stash": jnp.stack([probe] * slots),
             "terms": zero_terms(probe)}
    if train:
      carry["d_shared"], carry["d_stack"] = zeros_grads(shared), zeros_grads(stack)

    def tick(carry, row):
      f, b = row[0], row[1]
      out = dict(carry)

      def forward(c):
        mb = pick(f)
        h, terms = g(shared, stack, c["x"], mb)
        stash = c["stash"].at[jnp.maximum(f, 0) % slots].set(c["x"]) if train else c["stash"]
        add = terms if not train else zero_terms(h)
        return h, stash, jax.tree.map(jnp.add, c["terms"], add)

      skip_f = lambda c: (jnp.zeros_like(c["x"]), c["stash"], c["terms"])
      h, out["stash"], out["terms"] = jax.lax.cond(f >= 0, forward, skip_f, carry)
      dx = jnp.zeros_like(carry["g"])
      if train:
        def backward(c):
          mb = pick(b)
          x_b = c["stash"][jnp.maximum(b, 0) % slots]
          (_, terms), vjp = jax.vjp(lambda sh, st, x: g(sh, st, x, mb), shared, stack, x_b)
          seed = jnp.where(is_last, (1.0 if scale is None else scale) / total,
                           0.0).astype(jnp.float32)
          cot_terms = {k: jnp.zeros_like(v) for k, v in terms.items()}
          cot_terms["loss_sum"] = cot_terms["loss_sum"] + seed
          cot_h = jnp.where(is_last, jnp.zeros_like(c["g"]), c["g"])
          d_sh, d_st, d_x = vjp((cot_h, cot_terms))
          return (jax.tree.map(jnp.add, c["d_shared"], d_sh),
                  jax.tree.map(jnp.add, c["d_stack"], d_st), d_x,
                  jax.tree.map(jnp.add, c["terms"], terms))

        skip_b = lambda c: (c["d_shared"], c["d_stack"], jnp.zeros_like(c["g"]), c["terms"])
        after_f = dict(carry, stash=out["stash"], terms=out["terms"])
        out["d_shared"], out["d_stack"], dx, out["terms"] = jax.lax.cond(
            b >= 0, backward, skip_b, after_f)
      if self.stages > 1:
        out["x"] = jax.lax.ppermute(h, PIPE, [(i, i + 1) for i in range(self.stages - 1)])
        out["g"] = jax.lax.ppermute(dx, PIPE, [(i + 1, i) for i in range(self.stages - 1)])
      else:
        out["x"], out["g"] = jnp.zeros_like(h), jnp.zeros_like(dx)
      return out, None

    carry, _ = jax.lax.scan(tick, carry, table)
    terms = jax.tree.map(_invariant_over_tensor,
                         over_data(jax.lax.psum(carry["terms"], PIPE)))
    if not train:
      return terms
    d_shared = jax.tree.map(_invariant_over_tensor,
                            over_data(jax.lax.psum(carry["d_shared"], PIPE)))
    grads = {SHARED: d_shared, STACK: over_data(carry["d_stack"])}
    if per_replica:
      lead = lambda x: x[None]
      return jax.tree.map(lead, grads), jax.tree.map(lead, terms)
    return grads, terms
