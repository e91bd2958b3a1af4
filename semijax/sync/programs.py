"""The compiled programs of the replica modes, built from an engine's per-replica gradients
(`replica_grads_and_terms`: a tensor-parallel `core.engine.Engine`, whose replicas are tensor
groups, or a `core.pipeline.PipelineEngine`, whose replicas are data-parallel pipelines) and
its optimizer.

Shapes: R = replicas (the `data` mesh axis), P = a padded parameter (local: its `tensor`
shard). A *stacked* tree has a leading replica axis [R, *P] split over `data`, so each replica
holds its own slice (its in-flight gradient, or under local SGD its own parameters and optimizer
state); a plain tree is the engine's (replicated over `data`).

  compute   per-replica mean gradients of one microbatch each, on the current parameters;
            replicas flagged `start` store theirs in the stacked `pending` tree (ssaw, async).
            Under dynamic loss scaling (`core.loss_scale`) each is computed times the state's
            current scale and divided by it at once: pending gradients are unscaled, and one
            that overflowed makes the update that reads it skip and halve the scale;
  apply     one update from the pending gradients: their weighted sum (an all-reduce over
            `data`), the engine's optimizer, the learning rate times `lr_factor`;
  local     one local optimizer step of every replica on its own parameters (local SGD),
            each scaling its loss by its own optimizer state's scale;
  outer     the average of the replicas' parameters, or DiLoCo's outer Nesterov step on the
            averaged delta, sent back to every replica.

Every program is jitted once per engine and shape (compiled at warm-up); weights, the start
flags and the learning-rate factor are data, so they never recompile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import engine as engine_lib
from semijax.core import loss_scale
from semijax.core import mesh as mesh_lib
from semijax.sync import inflight
from semijax.sync import settings as settings_lib


def _stacked(sharding: NamedSharding) -> NamedSharding:
  """The sharding of a stacked [R, ...] version of an array placed with `sharding`."""
  return NamedSharding(sharding.mesh, P(mesh_lib.DATA, *sharding.spec))


def _per_replica(flags, x):
  """flags [R] broadcast against a stacked leaf x [R, ...]."""
  return flags.reshape((-1,) + (1,) * (x.ndim - 1))


class Programs:
  """The replica programs of one engine (see module doc).

  Args:
    engine: the run's engine (model, loss, optimizer; a (data, tensor) or (data, pipe, tensor)
      mesh).
    settings: the run's `SyncSettings` (local SGD's outer optimizer).
  """

  def __init__(self, engine: engine_lib.Engine, settings: settings_lib.SyncSettings):
    self.engine, self.settings = engine, settings
    self.num_replicas = engine.data_size
    self.stacked_params = jax.tree.map(_stacked, engine.param_shardings)
    self.forms = inflight.forms(engine)     # in-flight trees <-> host logical copies
    self._state_shardings = None     # of the padded state, known from the first state seen
    self._jitted: dict = {}

  def bind(self, state: engine_lib.TrainState) -> "Programs":
    """Takes the shardings of the run's padded state (call once, before the programs)."""
    if self._state_shardings is None:
      self._state_shardings = self.engine.state_shardings(state.params)
      e, plain, stacked = self.engine, self._state_shardings, self.stacked_state_shardings()
      self._jitted = {
          "compute": jax.jit(self._compute, donate_argnums=(1,),
                             out_shardings=(self.stacked_params, e.replicated)),
          "apply": jax.jit(self._apply, donate_argnums=(0,),
                           out_shardings=(plain, e.replicated)),
          "stack": jax.jit(self._stack, out_shardings=stacked),
          "local": jax.jit(self._local, donate_argnums=(0,),
                           out_shardings=(stacked, e.replicated)),
          "outer": jax.jit(self._outer, donate_argnums=(0, 1, 2),
                           out_shardings=(e.param_shardings, stacked, e.param_shardings)),
          "zeros": jax.jit(self._zeros, out_shardings=self.stacked_params)}
    return self

  def _run(self, name, *args):
    if name not in self._jitted:
      raise RuntimeError(f"Programs.{name}: call bind(state) first")
    with mesh_lib.lowering_scope(self.engine.mesh):   # traced once, in that scope
      return self._jitted[name](*args)

  def compute(self, state, pending, batch, plan, start):
    """`_compute`, compiled; `pending` is donated."""
    return self._run("compute", state, pending, batch, plan, start)

  def apply(self, state, pending, weights, lr_factor):
    """`_apply`, compiled; `state` is donated."""
    return self._run("apply", state, pending, weights, lr_factor)

  def stack(self, state):
    """`_stack`, compiled."""
    return self._run("stack", state)

  def local(self, replicas, batch, plan):
    """`_local`, compiled; `replicas` is donated."""
    return self._run("local", replicas, batch, plan)

  def outer(self, params, replicas, momentum):
    """`_outer`, compiled; every argument is donated."""
    return self._run("outer", params, replicas, momentum)

  def zeros(self, params):
    """`_zeros`, compiled."""
    return self._run("zeros", params)

  # --- helpers --------------------------------------------------------------------------------

  def stacked_state_shardings(self) -> engine_lib.TrainState:
    """Shardings of a stacked TrainState [R, *P] (local SGD's replicas)."""
    return jax.tree.map(_stacked, self._state_shardings)

  def _zeros(self, params):
    """A stacked tree of zeros shaped like `params` [R, *P]: no gradient in flight."""
    r = self.num_replicas
    return jax.tree.map(lambda x: jnp.zeros((r,) + x.shape, x.dtype), params)

  def _broadcast(self, tree, shardings):
    """tree [*P] -> [R, *P] with each replica's copy on its own devices."""
    r = self.num_replicas
    return jax.tree.map(lambda x, s: jax.lax.with_sharding_constraint(
        jnp.broadcast_to(x, (r,) + x.shape), s), tree, shardings)

  # --- the programs ---------------------------------------------------------------------------

  def _compute(self, state: engine_lib.TrainState, pending, batch, plan, start):
    """(pending with the flagged replicas' new mean gradients [R, *P] on `state`'s parameters,
    terms {name: [R]})."""
    stacked = self._broadcast(state.params, self.stacked_params)
    scale = loss_scale.scale_of(state.opt_state)
    if scale is not None:
      scale = jnp.broadcast_to(scale, (self.num_replicas,))
    grads, terms = self.engine.replica_grads_and_terms(stacked, batch, plan, scale)
    if scale is not None:
      grads = loss_scale.unscaled(grads, scale)
    pending = jax.tree.map(lambda g, old: jnp.where(_per_replica(start, g), g, old),
                           grads, pending)
    return pending, terms

  def _apply(self, state: engine_lib.TrainState, pending, weights, lr_factor):
    """One update: sum_r weights[r] pending[r] through the engine's optimizer, its step
    scaled by `lr_factor`. Returns (new state, {"grad_norm"[, "loss_scale"]})."""
    e = self.engine
    def combine(p, s):
      w = _per_replica(weights, p)
      return jax.lax.with_sharding_constraint(jnp.sum(jnp.where(w > 0, w * p, 0.0), 0), s)
    grads = jax.tree.map(combine, pending, e.param_shardings)
    updates, opt_state = e.tx.update(grads, state.opt_state, state.params)
    updates = jax.tree.map(lambda u: u * lr_factor, updates)
    params = optax.apply_updates(state.params, updates)
    metrics = {"grad_norm": optax.tree.norm(grads)}
    if (scale := loss_scale.scale_of(state.opt_state)) is not None:
      metrics["loss_scale"] = scale        # the scale before this update
    return engine_lib.TrainState(params, opt_state), metrics

  def _stack(self, state: engine_lib.TrainState) -> engine_lib.TrainState:
    """A state [*P] copied to every replica [R, *P] (local SGD's start)."""
    return self._broadcast(state, self.stacked_state_shardings())

  def _local(self, replicas: engine_lib.TrainState, batch, plan):
    """One local step of every replica on its own microbatch. Returns (replicas, terms {name:
    [R]}, with "loss_scale", the scales the step used, under dynamic loss scaling)."""
    scale = loss_scale.scale_of(replicas.opt_state)             # [R]: each replica's own
    grads, terms = self.engine.replica_grads_and_terms(replicas.params, batch, plan, scale)
    if scale is not None:
      grads, terms = loss_scale.unscaled(grads, scale), dict(terms, loss_scale=scale)
    updates, opt_state = jax.vmap(self.engine.tx.update)(grads, replicas.opt_state,
                                                         replicas.params)
    params = optax.apply_updates(replicas.params, updates)
    return engine_lib.TrainState(params, opt_state), terms

  def _outer(self, params, replicas: engine_lib.TrainState, momentum):
    """The outer step of local SGD (`outer_step`): (global params, replicas restarted from
    them, momentum)."""
    params, momentum = outer_step(self.settings, params, replicas.params, momentum)
    replicas = engine_lib.TrainState(self._broadcast(params, self.stacked_params),
                                     replicas.opt_state)
    return params, replicas, momentum


def outer_step(settings: settings_lib.SyncSettings, params, stacked, momentum):
  """Local SGD's outer step from the replicas' parameters `stacked` [R, *P]: (new global
  parameters [*P], new momentum [*P]) (`outer_update` of their mean)."""
  return outer_update(settings, params, jax.tree.map(lambda x: jnp.mean(x, 0), stacked),
                      momentum)


def outer_update(settings: settings_lib.SyncSettings, params, mean, momentum):
  """(new global parameters, new momentum) from the replicas' mean parameters.

  "average": the global parameters become the mean. "nesterov" (DiLoCo): the outer gradient
  delta = global - mean; momentum m <- mu m + delta; global <- global - lr (delta + mu m) (SGD
  with Nesterov momentum, as torch.optim.SGD(nesterov=True) computes it).
  """
  if settings.outer != "nesterov":
    return mean, momentum
  mu, lr = settings.outer_momentum, settings.outer_lr
  delta = jax.tree.map(jnp.subtract, params, mean)
  momentum = jax.tree.map(lambda m, d: mu * m + d, momentum, delta)
  params = jax.tree.map(lambda p, d, m: p - lr * (d + mu * m), params, delta, momentum)
  return params, momentum
