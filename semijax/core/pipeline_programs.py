"""The programs of a pipelined step (`PipePrograms`): the tick body (`pipeline_step.PipeStep`)
under `jax.shard_map` over the (data, pipe, tensor) mesh, the gradient and loss-term programs on
it, the optimizer step, and the compiled train and eval programs, kept per shape.
`core.pipeline` has the design (see its module doc).
"""

from __future__ import annotations

import functools
import logging

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import loss_scale
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline_step
from semijax.core import sharding
from semijax.core.engine import TrainState
from semijax.core.pipeline_layout import PipePlan

DATA, PIPE, TENSOR = mesh_lib.DATA, mesh_lib.PIPE, mesh_lib.TENSOR


class PipePrograms:
  """Runs one `PipeStep` sharded, and compiles (once per shape) its train and eval programs.

  Args:
    step: the per-device tick body (`pipeline_step.PipeStep`).
    mesh: a (data, pipe, tensor) mesh (`mesh.make_pipeline_mesh`).
    axes: the logical axes of pipelined parameters (`pipeline_model.PipeModel.axes`).
    param_shardings: the shardings of `axes` on `mesh`.
    tx: the optax optimizer (applied to the stacked parameters; padded rows stay zero).
  """

  def __init__(self, step: pipeline_step.PipeStep, mesh: jax.sharding.Mesh, axes: dict,
               param_shardings, tx: optax.GradientTransformation):
    self.step, self.mesh, self.axes, self.tx = step, mesh, axes, tx
    self.param_shardings = param_shardings
    self.replicated = NamedSharding(mesh, P())
    self._compiled: dict = {}
    self.compile_count = 0

  def _sharded(self, fn, out_specs, params, batch, pplan, scale=None, param_specs=None,
               scale_spec=P()):
    """`fn(params, batch, pplan[, scale])` under shard_map; `scale` (a loss scale: float32 []
    replicated, or [R] split over `data` by `scale_spec`) where given."""
    plan_specs = PipePlan({k: P(PIPE, TENSOR) for k in pplan.active}, P(PIPE), P(DATA),
                          pplan.widths)
    param_specs = sharding.specs(self.axes) if param_specs is None else param_specs
    in_specs = (param_specs, jax.tree.map(lambda _: P(DATA), batch), plan_specs)
    args = (params, batch, pplan)
    if scale is not None:
      in_specs, args = in_specs + (scale_spec,), args + (scale,)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(*args)

  def replica_grads_and_terms(self, stacked_params, batch, pplan, scale=None):
    """Each data-parallel pipeline's own gradients, on its own parameters: stacked_params
    [R, *P] (global; row d on pipeline d's devices) -> (gradients [R, *P] of each pipeline's
    mean loss over its own microbatches' tokens, times its loss scale `scale[d]` (float32 [R])
    where given; loss terms {name: [R]}). Nothing is summed over `data` (the replica modes of
    `semijax.sync` combine them)."""
    stacked = jax.tree.map(lambda s: P(DATA, *s), sharding.specs(self.axes))
    return self._sharded(functools.partial(self.step.local, train=True, per_replica=True),
                         (stacked, P(DATA)), stacked_params, batch, pplan, scale,
                         param_specs=stacked, scale_spec=P(DATA))

  def grads_and_terms(self, params, batch, pplan, scale=None):
    """(gradients like `params`, summed loss terms) of one step's global batch; the gradients
    of the mean loss times `scale` (float32 [], `core.loss_scale`) where given."""
    specs = sharding.specs(self.axes)
    return self._sharded(functools.partial(self.step.local, train=True), (specs, P()), params,
                         batch, pplan, scale)

  def _train_step(self, state: TrainState, batch, pplan):
    scale = loss_scale.scale_of(state.opt_state)
    grads, terms = self.grads_and_terms(state.params, batch, pplan, scale)
    if scale is not None:      # back to the loss's own gradients, before anything reads them
      grads = loss_scale.unscaled(grads, scale)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": terms["loss_sum"] / terms["count"],
               "accuracy": terms["correct"] / terms["count"], "grad_norm": optax.tree.norm(grads)}
    if scale is not None:
      metrics["loss_scale"] = scale
    return TrainState(params, opt_state), metrics

  def _eval_terms(self, params, batch, pplan):
    return self._sharded(functools.partial(self.step.local, train=False), P(), params, batch,
                         pplan)

  def compiled(self, kind, state_or_params, batch, pplan):
    """The compiled "train" (on a state, donated) or "eval" (on parameters) program for these
    shapes, compiled on first use."""
    params = state_or_params.params if kind == "train" else state_or_params
    key = (kind, tuple(x.shape for x in jax.tree.leaves(params)), jax.tree.structure(pplan),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(pplan)),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch)))
    fn = self._compiled.get(key)
    if fn is None:
      abstract = lambda t: jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
      if kind == "train":
        out_sh = (TrainState(self.param_shardings, jax.tree.map(lambda x: x.sharding,
                                                                state_or_params.opt_state)),
                  self.replicated)
        jitted = jax.jit(self._train_step, donate_argnums=(0,), out_shardings=out_sh)
      else:
        jitted = jax.jit(self._eval_terms, out_shardings=self.replicated)
      with mesh_lib.lowering_scope(self.mesh):
        fn = jitted.lower(abstract(state_or_params), abstract(batch), abstract(pplan)).compile()
      self.compile_count += 1
      logging.info("compiled pipelined %s step (%d variants)", kind, len(self._compiled) + 1)
      self._compiled[key] = fn
    return fn

  def compile(self, state: TrainState, batch, pplan: PipePlan, eval_batch=None) -> None:
    self.compiled("train", state, batch, pplan)
    self.compiled("eval", state.params, batch if eval_batch is None else eval_batch, pplan)

  def train_step(self, state: TrainState, batch, pplan: PipePlan):
    """One optimizer step; `state` is donated. Returns (new state, metrics dict of scalars)."""
    return self.compiled("train", state, batch, pplan)(state, batch, pplan)

  def eval_terms(self, params, batch, pplan: PipePlan) -> dict:
    return self.compiled("eval", params, batch, pplan)(params, batch, pplan)
