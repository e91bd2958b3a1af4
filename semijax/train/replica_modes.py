"""The training loop of the replica modes: `config.sync.mode` ssaw, async and local_sgd.

`loop.train_and_evaluate` validates the config, builds the engine, balancer, checkpointer and
metric writer and restores the latest checkpoint as for a synchronous run, then hands them here
when the replicas do not step together and all live in this one process: the replicas are the
`data` axis of the mesh and their speeds are emulated (`hetero.replica_slowdown`). With several
processes, one replica each, `replica_processes` trains instead. A pipelined run's
data-parallel pipelines come here too (a `PipelineEngine`, `pipelined.FixedPlan` as the
placement, the pipelines' emulated times as the replicas' speeds).

Differences from the synchronous loop, all following from replicas that do not step together:
  * an *update* is one round (ssaw, async) or one local step of every replica (local_sgd); the
    run ends when every sample of its budget (steps x batch_size) has been applied, which may
    take more updates than `steps` (ssaw and async make smaller updates);
  * the learning-rate schedule runs over samples applied (`steps` x batch_size of them);
  * each update's wall time is its real compute plus the emulated seconds the round rule gives
    (the host sleeps them), not the slowest tensor device of a lockstep step;
  * evaluation comes when the samples applied cross a multiple of eval_every x batch_size (and
    at the end); local_sgd evaluates the averaged model at its next average;
  * checkpoints (every checkpoint_every updates and at the end) also hold the in-flight state
    (`extra["sync"]`), so a resumed run continues exactly.
The summary has the synchronous loop's keys plus "sync": samples, updates, the validation curve
against wall time and the microbatches each replica computed.
"""

from __future__ import annotations

import collections
import math
import time
import weakref
from typing import Callable

import jax
import numpy as np

from semijax.core import compiles
from semijax.core import emulation
from semijax.core import engine as engine_lib
from semijax.sync import programs as programs_lib
from semijax.sync import rounds as rounds_lib
from semijax.train import config as config_lib
from semijax.train import executor as executor_lib
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib


say = metrics_lib.say


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


def train(run: config_lib.RunConfig, engine, balancer: executor_lib.Placement, ckpt, writer,
          dataset, state, start: int, extra: dict | None, *,
          after_warmup: Callable[[], None] | None, evaluate: Callable,
          meta: dict | None = None) -> dict:
  """Trains a replica mode in one process to the end of its sample budget (see module doc);
  returns the summary. Called by `loop.train_and_evaluate` with a `core.engine.Engine` and its
  `Balancer`, or a `PipelineEngine` and its fixed plan (`pipelined.FixedPlan`) as `balancer`;
  the caller owns and closes the resources; `meta` joins every checkpoint's metadata."""
  driver = (_LocalSGD if run.sync.mode == "local_sgd" else _Rounds)(run, engine, balancer)
  return _Loop(run, engine, balancer, ckpt, writer, dataset, driver, evaluate, meta).train(
      state, start, extra, after_warmup)


# --- drivers: what one update is in each mode -------------------------------------------------


class _Update:
  """What one update did (host numbers)."""

  def __init__(self, samples: int, emulated_s: float, loss: float | None, accuracy: float | None,
               scalars: dict, evaluable: bool = True):
    self.samples, self.emulated_s = samples, emulated_s
    self.loss, self.accuracy, self.scalars, self.evaluable = loss, accuracy, scalars, evaluable


def _replica_loss(terms, started) -> tuple[float | None, float | None]:
  """Mean loss and accuracy over the replicas flagged `started` of per-replica terms."""
  if terms is None or not np.any(started):
    return None, None
  t = {k: np.asarray(v)[started] for k, v in jax.device_get(terms).items()}
  return float(t["loss_sum"].sum() / t["count"].sum()), float(t["correct"].sum() / t["count"].sum())


class _Rounds:
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
    scratch, _ = progs.compute(state.params, scratch, batch, plan, np.ones(r, bool))
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
      loss, acc = _replica_loss(res.terms, res.started)
    scalars = {"train/grad_norm": float(res.metrics["grad_norm"]),
               "sync/members": len(rnd.members), "sync/max_staleness": max(rnd.staleness),
               "sync/mean_staleness": float(np.mean(rnd.staleness)),
               "sync/lr_scale": res.lr_scale, "sync/step": float(res.step),
               "sync/emulated_s": res.emulated_s}
    return state, _Update(sum(rnd.samples), res.emulated_s, loss, acc, scalars)

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


class _LocalSGD:
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
    loss, acc = _replica_loss(terms, np.ones(r, bool))
    outer = self.step % self.run.sync.local_steps == 0 or self.done
    if outer:
      params, self.replicas, self.momentum = self.programs.outer(state.params, self.replicas,
                                                                 self.momentum)
      state = engine_lib.TrainState(params, state.opt_state)
    scalars = {"sync/outer": float(outer)}
    return state, _Update(self.run.batch_size, float(np.max(durations)), loss, acc, scalars,
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


# --- the loop -----------------------------------------------------------------------------------


class _Loop:
  """Warm-up, updates, evaluation, checkpoints and metrics of a one-process replica run."""

  def __init__(self, run, engine, balancer, ckpt, writer, dataset, driver, evaluate, meta=None):
    self.run, self.engine, self.balancer = run, engine, balancer
    self.ckpt, self.writer, self.driver, self.evaluate = ckpt, writer, driver, evaluate
    self.meta = dict(meta or {})
    self.batches = Batches(dataset, run.mesh.data)
    self.eval_batches = [engine.shard_batch(b) for b in dataset.eval_batches()]
    factors = run.sync.replica_slowdown or (1.0,) * run.mesh.data
    self.factors = np.asarray(factors, np.float64)

  def durations(self) -> np.ndarray:
    """Emulated seconds of each replica's microbatch now: its tensor group's emulated time
    (`Balancer.delay_s`; a pipelined run's `FixedPlan.delay_s` gives one per pipeline) times its
    factor; 1 each (and no sleeping) without emulation."""
    base = self.balancer.delay_s if self.balancer.emulator is not None else 1.0
    return base * self.factors

  def train(self, state, start: int, extra: dict | None, after_warmup) -> dict:
    run, engine, balancer, driver = self.run, self.engine, self.balancer, self.driver
    t0 = time.perf_counter()
    state = balancer.warm_up(state, engine.shard_batch(self.batches.global_batch(0)),
                             self.eval_batches[0], step=0)
    state, plan = balancer.before_step(start, state)
    state = driver.warm_up(state, plan, self.batches)
    balancer.compiles_at_warmup = compiles.count()    # the replica programs are warm-up too
    d = np.broadcast_to(self.durations(), self.factors.shape)
    slowdown = tuple(round(float(x), 3) for x in d / d.min())
    say(f"warm-up: sync mode {run.sync.mode}, {run.mesh.data} replicas (time per microbatch "
        f"relative to the fastest {slowdown}), {time.perf_counter() - t0:.1f} s")
    saved = (extra or {}).get("sync")
    if saved is None:     # the loop may nest the host state under "balance"
      saved = ((extra or {}).get("balance") or {}).get("sync")
    if saved is not None:
      driver.load_state_dict(saved, balancer.layout)
    else:
      state = driver.begin(state, plan, self.batches, self.durations())
    if after_warmup is not None:
      after_warmup()
    return self._updates(state, start)

  def _updates(self, state, start: int) -> dict:
    run, engine, balancer, driver = self.run, self.engine, self.balancer, self.driver
    emulated = balancer.emulator is not None
    unit = run.model.unit
    per_sample = run.model.items_per_example
    budget = run.steps * run.batch_size
    applied = driver.applied
    next_eval = (applied // (run.eval_every * run.batch_size) + 1) * run.eval_every
    times, losses, curve, val = [], [], [], {}
    clock = 0.0
    k = start
    while not driver.done:
      k += 1
      t0 = time.perf_counter()
      state, plan = balancer.before_step(k - 1, state)
      state, u = driver.update(state, plan, self.batches, self.durations())
      if emulated:
        emulation.Emulator.sleep(u.emulated_s)
      balancer.after_step(k - 1, time.perf_counter() - t0)
      dt = time.perf_counter() - t0
      if u.loss is not None and not math.isfinite(u.loss):
        raise FloatingPointError(f"train/loss is {u.loss} at update {k}: training stopped; lower "
                                 "config.optimizer.learning_rate or check the data.")
      # An update whose round started no gradient measured no loss: it repeats the last one
      # (an ssaw run's first round may close before any replica computed after it).
      loss = u.loss if u.loss is not None else (losses[-1] if losses else None)
      applied += u.samples
      clock += dt
      times.append(dt)
      if loss is not None:
        losses.append(loss)
      progress = applied / run.batch_size
      scalars = {"train/step_time_s": dt,
                 f"train/{unit}_per_s": u.samples * per_sample / dt, "sync/samples": applied,
                 "sync/progress": progress, **u.scalars}
      if loss is not None:
        scalars["train/loss"] = loss
      if u.accuracy is not None:
        scalars["train/accuracy"] = u.accuracy
      if u.evaluable and (progress >= next_eval or applied >= budget):
        val = self.evaluate(engine, driver.params(state), self.eval_batches, plan)
        scalars.update(val)
        curve.append([clock, applied, val["val/loss"], val["val/accuracy"]])
        while next_eval <= progress:
          next_eval += run.eval_every
      done = driver.done
      if k % run.log_every == 0 or done or "val/loss" in scalars:
        self.writer.write(k, scalars)
        shown = "".join(f" | {n} {scalars[key]:.4f}" for n, key in (
            ("loss", "train/loss"), ("val_loss", "val/loss")) if key in scalars)
        say(f"update {k} | {progress:.1f}/{run.steps} batches{shown} | {dt:.3f} s | "
            f"{scalars[f'train/{unit}_per_s']:,.0f} {unit}/s")
      if (run.checkpoint_every and k % run.checkpoint_every == 0) or done:
        self._save(k, state)
    return self._summary(start, k, times, losses, curve, val, applied)

  def _save(self, k: int, state) -> None:
    layout = self.balancer.layout
    extra = dict(self.balancer.state_dict() or {})
    extra["sync"] = self.driver.state_dict(layout)
    meta = {**self.meta, "data_position": k, "layout": layout.to_json(),
            "model": self.run.model.to_dict(), "sync_mode": self.run.sync.mode,
            "samples": self.driver.applied}
    self.ckpt.save(k, self.engine.to_logical(state, layout), meta, extra)

  def _summary(self, start, k, times, losses, curve, val, applied) -> dict:
    run, unit = self.run, self.run.model.unit
    total = float(np.sum(times)) if times else 0.0
    items = applied * run.model.items_per_example
    mean_dt = float(np.mean(times)) if times else float("nan")
    summary = {"steps": k, "start_step": start,
               "train/loss": losses[-1] if losses else float("nan"), **val,
               "mean_step_time_s": mean_dt, f"{unit}_per_s": items / total if total else 0.0,
               "step_times_s": times, "losses": losses,
               "balance": self.balancer.summary(total),
               "sync": {"mode": run.sync.mode, "updates": k, "samples": applied,
                        "curve": curve, **self.driver.summary()}}
    say(f"done: {k} updates, {applied} samples, {summary[f'{unit}_per_s']:,.0f} {unit}/s, "
        f"val_loss {val.get('val/loss', float('nan')):.4f}")
    return summary
