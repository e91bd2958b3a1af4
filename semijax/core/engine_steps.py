"""The engine's sharded computation: `StepFunctions`, the loss under `jax.shard_map` (batch split
over `data`, units over `tensor`), its gradients, and the pure train and eval steps that
`engine_programs.StepPrograms` compiles."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from semijax.core import engine_state
from semijax.core import loss_scale as loss_scale_lib
from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib
from semijax.core import repeated
from semijax.core import resize as resize_lib
from semijax.core import sharding


def _paths(names: tuple) -> nnx.filterlib.Filter:
  """The NNX filter of the variables under any of the top-level modules `names`."""
  return nnx.Any(*(nnx.PathContains(p) for p in names))


def _mean(grads, terms: dict, params):
  """Summed gradients divided by the summed token count, in the parameters' dtypes."""
  return jax.tree.map(lambda g, p: (g / terms["count"]).astype(p.dtype), grads, params)


class StepFunctions:
  """The traceable functions of one model on one mesh: loss, gradients and steps on padded
  parameters and a batch split over `data`.

  Args:
    graphdef: the model's NNX graphdef.
    loss_terms: (logits, batch) -> {"loss_sum", "count", "correct"} local sums (`tasks`).
    input_key: the batch entry the model reads.
    axes: the `sharding.Axes` tree of the parameters.
    unit_sizes: {kind: width of one unit}.
    mesh: the (data, tensor) mesh.
    tx: the optax optimizer.
    accumulation: K, microbatches a train step runs in sequence, adding their gradients before
      its one update (gradient accumulation: activations of B / K examples live at a time).
  """

  def __init__(self, graphdef, loss_terms: Callable, input_key: str, axes, unit_sizes: dict,
               mesh: jax.sharding.Mesh, tx: optax.GradientTransformation,
               accumulation: int = 1):
    if accumulation < 1:
      raise ValueError(f"gradient_accumulation_steps: {accumulation} is not a positive integer")
    self.graphdef, self.loss_terms, self.input_key = graphdef, loss_terms, input_key
    self.axes, self.unit_sizes, self.mesh, self.tx = axes, unit_sizes, mesh, tx
    self.accumulation = accumulation
    self.trace_count = 0     # traces of the train and eval steps

  def _model_terms(self, params, batch, plan) -> dict:
    """This device's loss terms on its rows of `batch`, invariant over `tensor`; under a plan
    that may drain a device, a drained device skips the embedding, the head and the loss
    (`core.repeated`)."""
    model = nnx.merge(self.graphdef, params)
    inputs = batch[self.input_key]
    if not repeated.drains(plan):
      return self.loss_terms(model(inputs, plan), batch)
    # The stem's and the head's parameters (shared, where the head is tied to the embedding)
    # enter both conds, cast once to vary like the batch (`mesh.vary_alike`).
    graphdef, head, stem, rest = nnx.split(model, _paths(model.head_paths),
                                           _paths(model.stem_paths), ...)
    parts = mesh_lib.vary_alike((head, stem), (*mesh_lib.varying_axes(inputs), mesh_lib.TENSOR))
    part = lambda parts: nnx.merge(graphdef, *parts, rest)
    x = repeated.stem(lambda inputs, parts: part(parts).stem(inputs), inputs, parts, plan)
    x = model.encoder.run_blocks(x, plan)
    terms = lambda x, parts: self.loss_terms(part(parts).head_out(x), batch)
    return repeated.head_terms(terms, x, parts, plan)

  def _local_terms(self, params, batch, plan):
    return jax.lax.psum(self._model_terms(params, batch, plan), mesh_lib.DATA)

  def _sharded(self, fn, out_specs, params, batch, plan, *replicated):
    """`fn(params, batch, plan, *replicated)` under `shard_map` (`replicated`: arrays every
    device holds whole, e.g. the loss scale)."""
    in_specs = (sharding.specs(self.axes), jax.tree.map(lambda _: P(mesh_lib.DATA), batch),
                plan_lib.plan_specs(plan), *(P() for _ in replicated))
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(
        params, batch, plan, *replicated)

  def loss_terms_fn(self, params, batch, plan) -> dict:
    """Global {"loss_sum", "count", "correct"} of padded `params` on a sharded batch."""
    return self._sharded(self._local_terms, P(), params, batch, plan)

  def loss(self, params, batch, plan):
    """Mean loss over the global batch, and the summed terms."""
    terms = self.loss_terms_fn(params, batch, plan)
    return terms["loss_sum"] / terms["count"], terms

  def replica_grads_and_terms(self, stacked_params, batch, plan, scale=None):
    """Each data replica's own gradients, on its own parameters: stacked_params [R, *P]
    (global; row r on replica r's tensor group) -> (gradients [R, *P] of each replica's mean
    loss over its own rows of `batch`, times its loss scale `scale[r]` (float32 [R],
    `core.loss_scale`) where given; loss terms {name: [R]}). Nothing is summed over `data`
    (the replica modes of `semijax.sync` combine them). Over `accumulation` microbatches of
    each replica's rows where it is > 1 (`_accumulate`)."""
    stacked = jax.tree.map(lambda a: P(mesh_lib.DATA, *a.spec()), self.axes)
    in_specs = (stacked, jax.tree.map(lambda _: P(mesh_lib.DATA), batch),
                plan_lib.plan_specs(plan))

    lead = lambda t: jnp.reshape(t, (1,) + t.shape)

    if self.accumulation > 1:
      def accumulated(params, batch, plan, *scale):   # this replica's own mean, of microbatches
        params = jax.tree.map(lambda x: x[0], params)
        grads, terms = self._accumulate(params, batch, plan, *(x[0] for x in scale))
        return jax.tree.map(lead, (_mean(grads, terms, params), terms))
      scales = () if scale is None else (scale,)
      return jax.shard_map(accumulated, mesh=self.mesh,
                           in_specs=in_specs + tuple(P(mesh_lib.DATA) for _ in scales),
                           out_specs=(stacked, P(mesh_lib.DATA)))(stacked_params, batch, plan,
                                                                  *scales)

    def local(params, batch, plan):
      return jax.tree.map(lead, self._model_terms(jax.tree.map(lambda x: x[0], params), batch,
                                                  plan))

    def losses(stacked_params):
      terms = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs,
                            out_specs=P(mesh_lib.DATA))(stacked_params, batch, plan)
      means = terms["loss_sum"] / terms["count"]
      return jnp.sum(means if scale is None else means * scale), terms

    (_, terms), grads = jax.value_and_grad(losses, has_aux=True)(stacked_params)
    return grads, terms

  def logits(self, params, batch, plan) -> jax.Array:
    """Logits [global batch, ...] (batch split over data), for tests and inspection."""
    def local(params, batch, plan):
      return nnx.merge(self.graphdef, params)(batch[self.input_key], plan)
    return jax.jit(lambda p, b, pl: self._sharded(local, P(mesh_lib.DATA), p, b, pl))(
        params, batch, plan)

  def microbatches(self, batch):
    """A data shard's rows [n, ...] as K microbatches [K, n / K, ...] of consecutive rows (inside
    `shard_map`; each microbatch of the global batch is then split evenly over the shards)."""
    k = self.accumulation

    def split(x):
      if x.shape[0] % k:
        raise ValueError(f"gradient_accumulation_steps: a data shard's {x.shape[0]} rows do not "
                         f"split into {k} microbatches")
      return x.reshape((k, x.shape[0] // k) + x.shape[1:])
    return jax.tree.map(split, batch)

  def _accumulate(self, params, batch, plan, scale=1.0):
    """Inside `shard_map`: sums over `accumulation` microbatches of this data shard's rows (a
    `lax.scan`) of the gradient of the loss sum times `scale` (`core.loss_scale`), and of the
    loss terms, both typed as varying over `data` (the parameters enter so typed: a
    microbatch's gradient stays on its shard, and the loop has no all-reduce over `data`). Sums
    in float32 at least."""
    params = jax.tree.map(lambda x: mesh_lib.vary(x, (mesh_lib.DATA,)), params)

    def loss_sum(params, mb):                 # (the value to differentiate, every term)
      terms = self._model_terms(params, mb, plan)
      return terms["loss_sum"] * scale, terms

    def add(acc, mb):
      (_, terms), grads = jax.value_and_grad(loss_sum, has_aux=True)(params, mb)
      return jax.tree.map(jnp.add, acc, (grads, terms)), None

    micro = self.microbatches(batch)
    wide = lambda dtype: jnp.promote_types(dtype, jnp.float32)
    terms = jax.eval_shape(lambda mb: loss_sum(params, mb)[1], jax.tree.map(lambda x: x[0], micro))
    zeros = (jax.tree.map(lambda p: jnp.zeros_like(p, wide(p.dtype)), params),   # typed as p
             jax.tree.map(lambda t: mesh_lib.vary(jnp.zeros(t.shape, wide(t.dtype)),
                                                  (mesh_lib.DATA,)), terms))
    return jax.lax.scan(add, zeros, micro)[0]

  def _accumulated(self, params, batch, plan, scale):
    """Inside `shard_map`: the gradient of the global batch's mean loss (times `scale`) and the
    global terms, summed over `data` once, after the microbatches (`_accumulate`), and divided
    by the whole batch's count (a mean of microbatch means would weigh unequal counts wrong)."""
    grads, terms = jax.lax.psum(self._accumulate(params, batch, plan, scale), mesh_lib.DATA)
    return _mean(grads, terms, params), terms

  def grads_and_terms(self, params, batch, plan, scale=None):
    """(gradients of the mean loss over the global batch, its summed terms): in one pass, or
    over `accumulation` microbatches (`_accumulated`). `scale` (float32 [], `core.loss_scale`)
    multiplies the loss the gradients are taken of, so they come back multiplied by it."""
    if self.accumulation == 1:
      def scaled(params):
        loss, terms = self.loss(params, batch, plan)
        return loss if scale is None else loss * scale, terms
      (_, terms), grads = jax.value_and_grad(scaled, has_aux=True)(params)
      return grads, terms
    scale = jnp.ones((), jnp.float32) if scale is None else scale
    return self._sharded(self._accumulated, (sharding.specs(self.axes), P()), params, batch, plan,
                         scale)

  def train_step(self, state: engine_state.TrainState, batch, plan):
    """The pure train step: (padded state, sharded batch, plan) -> (new state, metrics)."""
    self.trace_count += 1
    scale = loss_scale_lib.scale_of(state.opt_state)
    grads, terms = self.grads_and_terms(state.params, batch, plan, scale)
    if scale is not None:      # back to the loss's own gradients, before anything reads them
      grads = loss_scale_lib.unscaled(grads, scale)
    loss = terms["loss_sum"] / terms["count"]
    if plan.resize is not None:
      masks = resize_lib.skip_masks(plan.resize, plan.active, self.axes, self.unit_sizes)
      grads = resize_lib.impute_gradients(plan.resize, masks, grads)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if plan.resize is not None:   # optionally keep skipped weights and moments as they were
      params = resize_lib.freeze(plan.resize, masks, params, state.params)
      opt_masks = sharding.map_params(self.tx, lambda _, m: m, opt_state, masks,
                                      non_params=lambda _: jnp.zeros((), bool))
      opt_state = resize_lib.freeze(plan.resize, opt_masks, opt_state, state.opt_state)
    metrics = {"loss": loss, "accuracy": terms["correct"] / terms["count"],
               "grad_norm": optax.tree.norm(grads)}
    if scale is not None:
      metrics["loss_scale"] = scale
    return engine_state.TrainState(params, opt_state), metrics

  def eval_step(self, params, batch, plan):
    """The pure eval step: (padded params, sharded batch, plan) -> summed loss terms."""
    self.trace_count += 1
    return self.loss_terms_fn(params, batch, plan)
