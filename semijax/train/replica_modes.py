"""What one update is in each replica mode (`config.sync.mode` ssaw, async, local_sgd) of
one process, its replicas the `data` axis of the mesh: the drivers `Rounds` (ssaw, async: one
round of `sync.rounds.RoundRunner`) and `LocalSGD` (one local step of every replica, an outer
step every `local_steps`), the `Batches` they read, and the replica programs they share.
`replicas.Replicas` drives them as an executor of the training loop; `replica_processes` uses
the batches and programs with one replica per process.
"""

from __future__ import annotations

import collections
import weakref
from typing import Callable

import jax
import numpy as np

from semijax.core import engine as engine_lib
from semijax.sync import programs as programs_lib
from semijax.sync import rounds as rounds_lib
from semijax.train import config as config_lib
from semijax.train import optimizer as optimizer_lib




class Batches:
  """Host batches by index, from a dataset that holds every row of every global batch.

  Microbatch j is rows [(j mod R) m, (j mod R + 1) m) of global batch j div R (m = B / R): the
  rows replica j mod R feeds in a synchronous step. The last few global batches are cached
  (R consecutive microbatches come from one).
  """

  def __init__(self, dataset, num_replicas: int, keep: int = 4):
    self.dataset, self.num_replicas = dataset, num_replicas
    self.rows = dataset.batch_size // num_replicas
    self._cache: collections.OrderedDict = collections.OrderedDict()
    self._keep = keep

  def global_batch(self, k: int) -> dict:
    if k not in self._cache:
      self._cache[k] = self.dataset.train_batch(k)
      while len(self._cache) > self._keep:
        self._cache.popitem(last=False)
    return self._cache[k]

  def microbatch(self, j: int) -> dict:
    r = j % self.num_replicas
    rows = slice(r * self.rows, (r + 1) * self.rows)
    return {k: v[rows] for k, v in self.global_batch(j // self.num_replicas).items()}


# {engine: {outer optimizer: Programs}}: runs of one engine (benchmarks pass an engine cache)
# share the replica programs, so they compile once.
_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def programs_for(engine: engine_lib.Engine, settings) -> programs_lib.Programs:
  """The replica programs of `engine` for `settings` (shared between runs of the engine)."""
  key = (settings.outer, settings.outer_lr, settings.outer_momentum)
  by_settings = _PROGRAMS.setdefault(engine, {})
  if key not in by_settings:
    by_settings[key] = programs_lib.Programs(engine, settings)
  return by_settings[key]


def learning_rate_fn(run: config_lib.RunConfig) -> Callable[[float], float]:
  """progress (in global batches, a float) -> the run's scheduled learning rate."""
  schedule = jax.jit(optimizer_lib.learning_rate_schedule(run.optimizer, run.steps))
  return lambda progress: float(schedule(np.float32(progress)))


# --- drivers: what one update is in each mode -------------------------------------------------


class Update:
  """What one update did (host numbers)."""

  def __init__(self, samples: int, emulated_s: float, loss: float | None, accuracy: float | None,
               scalars: dict, evaluable: bool = True):
    self.samples, self.emulated_s = samples, emulated_s
    self.loss, self.accuracy, self.scalars, self.evaluable = loss, accuracy, scalars, evaluable


def replica_loss(terms, started=None) -> tuple[float | None, float | None]:
  """Mean loss and accuracy of loss terms ({loss_sum, correct, count}, each [replicas] or a
  scalar) over the replicas flagged `started` (default: all); (None, None) with none."""
  if terms is None or (started is not None and not np.any(started)):
    return None, None
  terms = jax.device_get(terms)
  if started is None:
    started = np.ones(np.shape(terms["count"]), bool)
  t = {k: np.asarray(v)[started] for k, v in terms.items()}
  return float(t["loss_sum"].sum() / t["count"].sum()), float(t["correct"].sum() / t["count"].sum())


class Rounds:
  """ssaw / async: one update = one round of `sync.rounds.RoundRunner`."""

  def __init__(self, run, engine, balancer):
    self.run, self.engine = run, engine
    r = run.mesh.data
    self.runner = rounds_lib.RoundRunner(
        engine, run.sync, batch_size=run.batch_size, total_microbatches=run.steps * r,
        learning_rate=learning_rate_fn(run), programs=programs_for(engine, run.sync))
    self.owner = np.full(run.steps * r, -1, np.int64)   # the replica that computed each
                                                         # applied microbatch (-1: not yet)

  @property
  def done(self) -> bool:
    return self.runner.done

  @property
  def applied(self) -> int:
    return self.runner.applied

  def warm_up(self, state, plan, batches: Batches):
    """Compiles the round programs and runs each once on throwaway copies."""
    self.runner.bind(state)
    progs, r = self.runner.programs, self.run.mesh.data
    batch = self.engine.shard_batch(batches.global_batch(0))
    scratch = progs.zeros(state.params)
    scratch, _ = progs.compute(state, scratch, batch, plan, np.ones(r, bool))
    copy = jax.tree.map(lambda x: x.copy(), state)
    jax.block_until_ready(progs.apply(copy, scratch, np.full(r, 1.0 / r, np.float32),
                                      np.float32(1.0)))
    self.runner.learning_rate(0.5)
    return state

  def begin(self, state, plan, batches, durations):
    self.runner.start(state, plan, batches.microbatch, durations)
    return state

  def update(self, state, plan, batches, durations):
    state, res = self.runner.round(state, plan, batches.microbatch, batches.global_batch,
                                   durations)
    rnd = res.round
    for r, j in zip(rnd.members, rnd.microbatches):
      if self.owner[j] != -1:
        raise RuntimeError(f"microbatch {j} applied twice (replicas {self.owner[j]} and {r})")
      self.owner[j] = r
    if res.step:
      m = jax.device_get(res.metrics)
      loss, acc = float(m["loss"]), float(m["accuracy"])
    else:
      loss, acc = replica_loss(res.terms, res.started)
    scalars = {"train/grad_norm": float(res.metrics["grad_norm"]),
               "sync/members": len(rnd.members), "sync/max_staleness": max(rnd.staleness),
               "sync/mean_staleness": float(np.mean(rnd.staleness)),
               "sync/lr_scale": res.lr_scale, "sync/step": float(res.step),
               "sync/emulated_s": res.emulated_s}
    if "loss_scale" in res.metrics:
      scalars["train/loss_scale"] = float(res.metrics["loss_scale"])
    return state, Update(sum(rnd.samples), res.emulated_s, loss, acc, scalars)

  def params(self, state):
    return state.params

  def summary(self) -> dict:
    return {"microbatches": [np.flatnonzero(self.owner == r).tolist()
                             for r in range(self.run.mesh.data)]}

  def state_dict(self, layout) -> dict:
    return {**self.runner.state_dict(layout), "owner": self.owner.copy()}

  def load_state_dict(self, state: dict, layout) -> None:
    self.runner.load_state_dict(state, layout)
    self.owner = np.asarray(state["owner"], np.int64).copy()


class LocalSGD:
  """local_sgd: one update = one local step of every replica on its own microbatch (replica r
  takes shard r of global batch k); every `local_steps` steps and at the end, the outer step
  (average, or DiLoCo's Nesterov) makes the global model and restarts the replicas from it."""

  def __init__(self, run, engine, balancer):
    self.run, self.engine = run, engine
    self.programs = programs_for(engine, run.sync)
    self.step = 0               # local steps done
    self.replicas = None        # stacked [R, *P] TrainState
    self.momentum = None        # outer momentum [*P]
    r = run.mesh.data
    self.microbatches = [[] for _ in range(r)]

  @property
  def done(self) -> bool:
    return self.step >= self.run.steps

  @property
  def applied(self) -> int:
    return self.step * self.run.batch_size

  def warm_up(self, state, plan, batches: Batches):
    progs = self.programs.bind(state)
    if self.replicas is None:
      self.replicas = progs.stack(state)
      self.momentum = jax.tree.map(lambda x: x * 0.0, state.params)
    batch = self.engine.shard_batch(batches.global_batch(0))
    copies = jax.tree.map(lambda x: x.copy(), (state.params, self.replicas, self.momentum))
    scratch, _ = progs.local(copies[1], batch, plan)
    jax.block_until_ready(progs.outer(copies[0], scratch, copies[2]))
    return state

  def begin(self, state, plan, batches, durations):
    return state

  def update(self, state, plan, batches, durations):
    k = self.step
    batch = self.engine.shard_batch(batches.global_batch(k))
    self.replicas, terms = self.programs.local(self.replicas, batch, plan)
    r = self.run.mesh.data
    for i in range(r):
      self.microbatches[i].append(k * r + i)
    self.step += 1
    terms = jax.device_get(terms)
    loss, acc = replica_loss(terms)
    outer = self.step % self.run.sync.local_steps == 0 or self.done
    if outer:
      params, self.replicas, self.momentum = self.programs.outer(state.params, self.replicas,
                                                                 self.momentum)
      state = engine_lib.TrainState(params, state.opt_state)
    scalars = {"sync/outer": float(outer)}
    if "loss_scale" in terms:            # the lowest of the replicas' scales this step used
      scalars["train/loss_scale"] = float(np.min(terms["loss_scale"]))
    return state, Update(self.run.batch_size, float(np.max(durations)), loss, acc, scalars,
                          evaluable=outer)

  def params(self, state):
    return state.params

  def summary(self) -> dict:
    return {"microbatches": self.microbatches}

  def state_dict(self, layout) -> dict:
    forms = self.programs.forms
    return {"step": np.int64(self.step), "replicas": forms.to_host(self.replicas, layout),
            "momentum": forms.to_host(self.momentum, layout, leading=0)}

  def load_state_dict(self, state: dict, layout) -> None:
    self.step = int(state["step"])
    progs = self.programs
    self.replicas = progs.forms.to_device(state["replicas"], self.replicas, layout,
                                          progs.stacked_state_shardings())
    self.momentum = progs.forms.to_device(state["momentum"], self.momentum, layout,
                                          self.engine.param_shardings, leading=0)
    r = self.run.mesh.data
    self.microbatches = [[k * r + i for k in range(self.step)] for i in range(r)]
