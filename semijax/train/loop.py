"""`train_and_evaluate(config, workdir)`: the training loop behind experiments/train.py.

Order of work, so that bad input never costs a compile or a saved checkpoint:
  1. validate the whole config into a typed `config.RunConfig` and build the data set (file
     errors surface here);
  2. build the mesh, model, optimizer, engine and balancer; restore the latest checkpoint from
     workdir/checkpoints if there is one (onto the layout this run starts in, which may differ
     from the one it was saved with), else initialize from the seed;
  3. compile (and exercise) every step variant the balancing policy may use, then train.

Resume order: the workdir's own latest checkpoint always wins; otherwise start from scratch.
Metrics go to workdir/metrics.jsonl and TensorBoard files (process 0 only). The console (process
0) shows where the run starts, the warm-up, every balancing change, progress lines and a final
summary; library chatter goes to the absl log. The checkpoint manager, the metric writer and the
decision log are closed on every path out, a NaN loss and an exception included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable

import jax
import numpy as np

from semijax import models
from semijax.balance import coordinator as coordinator_lib
from semijax.core import emulation
from semijax.core import engine as engine_lib
from semijax.core import mesh as mesh_lib
from semijax.errors import ConfigError
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib
from semijax.train import pipelined
from semijax.train import steps as steps_lib
from semijax.train import replica_loop
from semijax.train import replica_processes


say = metrics_lib.say


def build_engine(run: config_lib.RunConfig) -> engine_lib.Engine:
  """The engine of a run (model, optimizer, mesh)."""
  model_fn, loss_terms = models.build(run.model)
  return engine_lib.Engine(model_fn, loss_terms, run.mesh.make(),
                           optimizer_lib.make(run.optimizer, run.steps))


def build_emulator(run: config_lib.RunConfig) -> emulation.Emulator | None:
  """The emulated slowdown of a run (`config.hetero.slowdown`, `hetero.replica_slowdown`), or
  None. Emulated replicas need an emulator even without a tensor profile (their tensor groups'
  time is the unit their factors multiply); a sync step waits for the slowest replica, so under
  mode sync every tensor device's time is multiplied by the largest replica factor."""
  slowdown, replicas = run.hetero.slowdown, run.sync.replica_slowdown
  if slowdown is None and replicas is None:
    return None
  hetero = run.hetero
  if replicas is not None:
    factor = max(replicas) if run.sync.mode == "sync" else 1.0
    hetero = dataclasses.replace(hetero, slowdown=tuple(
        s * factor for s in (slowdown or (1.0,) * run.mesh.tensor)))
  tokens = run.batch_size // run.mesh.data * run.model.seq_len
  return emulation.Emulator(hetero, emulation.unit_ms(run.model.flops_per_unit(), tokens,
                                                      run.hetero.device_gflops))


def _cached_engine(run: config_lib.RunConfig, cache: dict | None) -> engine_lib.Engine:
  """A new engine, or one of `cache` whose model, mesh, optimizer (schedule included) and batch
  match. Runs of different lengths on one schedule share an engine and its compiled steps."""
  if cache is None:
    return build_engine(run)
  schedule = optimizer_lib.schedule_length(run.optimizer, run.steps)
  key = (run.model, run.mesh, dataclasses.replace(run.optimizer, schedule_steps=schedule),
         run.batch_size)
  if key not in cache:
    cache[key] = build_engine(run)
  return cache[key]


def _restore_or_init(engine, ckpt, run: config_lib.RunConfig, layout):
  """(padded state, start step, {"balance": host state, "snapshot": padded priority snapshot}
  or None) from the latest checkpoint in workdir, or fresh from the seed."""
  step = ckpt.latest_step()
  if step is None:
    return engine.init(run.seed, layout), 0, None
  meta = ckpt.read_meta(step)
  if meta.get("model") != run.model.to_dict():
    raise ConfigError(
        f"config.model: the checkpoint at step {step} in {ckpt.directory} was trained with model "
        f"{meta.get('model')}, not {run.model.to_dict()}; use another --workdir")
  if "pipe" in meta:
    raise ConfigError(
        f"config.mesh.pipe: the checkpoint at step {step} in {ckpt.directory} was saved by a "
        f"pipelined run on {meta['pipe']} stages; it restores onto a pipelined run with as many "
        "stages (use another --workdir)")
  abstract = engine.abstract_logical()
  logical, meta = ckpt.restore(abstract, step)
  say(f"resumed from step {step} ({ckpt.directory}/{step}, saved with MLP units "
      f"{_counts(meta['layout'], 'mlp')}{checkpoint_lib.dtype_change(meta, abstract)}), "
      f"continuing to step {run.steps}")
  snapshot = ckpt.restore_snapshot(abstract.params, step)
  extra = {"balance": ckpt.restore_extra(step), "snapshot": None if snapshot is None else
           engine.to_padded(snapshot, layout, donate=True)}
  return engine.to_padded(logical, layout, donate=True), int(meta["data_position"]), extra


def _save(ckpt, engine, balancer, state, step: int, meta: dict):
  """Saves a checkpoint; returns the state. The state (and a priority snapshot) go through the
  sharded logical form in place (donated group by group), so no device holds two copies."""
  layout = balancer.layout
  logical = engine.to_logical(state, layout, donate=True)
  snapshot = balancer.snapshot
  if snapshot is not None:
    snapshot = engine.to_logical(snapshot, layout, donate=True)
  ckpt.save(step, logical, meta, balancer.state_dict(), snapshot)
  if snapshot is not None:
    balancer.snapshot = engine.to_padded(snapshot, layout, donate=True)
  return engine.to_padded(logical, layout, donate=True)


def _counts(layout_json: dict, kind: str) -> tuple:
  return tuple(len(o) for o in layout_json[kind]["owned"])


def _already_trained(run: config_lib.RunConfig, workdir: str) -> dict | None:
  """The summary of a run with nothing left to do (its workdir holds a checkpoint of this model
  at config.steps or later), said on the console; None if there is training to do."""
  directory = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(directory):
    return None
  ckpt = checkpoint_lib.Checkpointer(directory, keep=run.keep_checkpoints)
  try:
    step = ckpt.latest_step()
    meta = ckpt.read_meta(step) if step is not None else {}
  finally:
    ckpt.close()
  if meta.get("model") != run.model.to_dict():
    return None
  # A replica run's checkpoints count updates, which may outnumber steps: it is done when its
  # samples are (and one saved before they were recorded, never).
  trained = (meta.get("samples", -1) // run.batch_size if "sync_mode" in meta else step)
  if trained < run.steps:
    return None
  path = os.path.join(workdir, "metrics.jsonl")
  records = metrics_lib.read_jsonl(path) if os.path.exists(path) else []
  val = next(({k: r[k] for k in ("val/loss", "val/accuracy") if k in r}
              for r in reversed(records) if "val/loss" in r), {})
  shown = f", val_loss {val['val/loss']:.4f}" if "val/loss" in val else ""
  say(f"nothing to train: the checkpoint {directory}/{step} has trained {trained} steps, "
      f"config.steps is {run.steps}{shown}; raise --config.steps to train on")
  return dict(steps_lib.summary(run, step, [], [], val), already_trained=True)


def train_and_evaluate(config, workdir: str, *, after_warmup: Callable[[], None] | None = None,
                       engine_cache: dict | None = None) -> dict:
  """Trains `config` in `workdir` (auto-resuming) and returns a summary of the run.

  Args:
    config: the run's ConfigDict (validated here, the only place it is read).
    workdir: where checkpoints, metrics and decisions go.
    after_warmup: called once everything is compiled, right before the first step (e.g. a
      benchmark starts its contention there).
    engine_cache: a dict to reuse engines (and their compiled steps) across runs in one process
      whose model, mesh, optimizer and emulation settings match (benchmarks).

  Returns:
    {"steps", "train/loss", "val/loss", "val/accuracy", "mean_step_time_s", "<unit>_per_s",
     "step_times_s": [...], "losses": [...], "balance": {...}} for the steps run by this call;
    {..., "already_trained": True} and no steps if the workdir's checkpoint is at config.steps.

  Raises:
    ConfigError: bad config or data (before compiling).
    FloatingPointError: a NaN or infinite loss (the last good checkpoint stays intact).
  """
  run = config_lib.validate(config, jax.device_count(), jax.process_count())
  if (done := _already_trained(run, workdir)) is not None:
    return done
  if run.pipeline is not None:
    return pipelined.train(run, workdir, after_warmup=after_warmup)
  feed_index, feeds = mesh_lib.batch_feed(run.mesh.make())
  dataset = data_lib.build(run.data, feed_index, feeds)
  engine = _cached_engine(run, engine_cache)
  with contextlib.ExitStack() as stack:
    balancer = coordinator_lib.Balancer.create(
        engine, settings=run.balance, resize_spec=run.resize, hetero=run.hetero, spec=run.model,
        layout=run.layout, workdir=workdir, steps_per_epoch=dataset.steps_per_epoch,
        seed=run.seed, emulator=build_emulator(run))
    stack.callback(balancer.close)
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=run.keep_checkpoints)
    stack.callback(ckpt.close)
    state, start, extra = _restore_or_init(engine, ckpt, run, balancer.layout)
    if extra is not None:
      balancer.load_state_dict(extra["balance"])
      if extra["snapshot"] is not None:
        balancer.snapshot = extra["snapshot"]
    writer = stack.enter_context(metrics_lib.MetricWriter(workdir, resume_step=start))
    writer.write_config(run.source)
    if run.sync.mode != "sync" and jax.process_count() > 1:    # one replica per process
      return replica_processes.train(run, engine, writer, state, start,
                                     after_warmup=after_warmup, evaluate=steps_lib.evaluate)
    if run.sync.mode != "sync":     # emulated replicas that do not step together
      return replica_loop.train(run, engine, balancer, ckpt, writer, dataset, state, start,
                                extra, after_warmup=after_warmup, evaluate=steps_lib.evaluate)
    return _train(run, engine, balancer, ckpt, writer, dataset, state, start, after_warmup)


def _train(run, engine, balancer, ckpt, writer, dataset, state, start, after_warmup) -> dict:
  """Warm-up and the steps of `train_and_evaluate` (its resources are closed by the caller)."""
  learning_rates = steps_lib.learning_rates(run)
  eval_batches = [engine.shard_batch(b) for b in dataset.eval_batches()]
  t0 = time.perf_counter()
  compiles_before = engine.compile_count
  state = balancer.warm_up(state, engine.shard_batch(dataset.train_batch(start)), eval_batches[0],
                           step=start)
  steps_lib.start_together("semijax warm-up")
  say(f"warm-up: policy {balancer.policy.name}, {engine.compile_count - compiles_before} step "
      f"programs compiled, {time.perf_counter() - t0:.1f} s")
  if after_warmup is not None:
    after_warmup()

  unit = run.model.unit
  items_per_step = run.batch_size * run.model.items_per_example
  progress = metrics_lib.Progress(run.steps, unit=unit, start_step=start)
  step_times, losses, val = [], [], {}
  last_saved = start if start else None
  for step in range(start + 1, run.steps + 1):
    batch = engine.shard_batch(dataset.train_batch(step - 1))
    t0 = time.perf_counter()
    state, plan = balancer.before_step(step - 1, state)   # may migrate the state
    t1 = time.perf_counter()
    state, m = engine.train_step(state, batch, plan)
    loss = float(m["loss"])                          # waits for the step
    balancer.emulate()                               # an emulated straggler's extra time
    balance_scalars = balancer.after_step(step - 1, time.perf_counter() - t1)
    dt = time.perf_counter() - t0                    # the step and everything balancing costs
    steps_lib.stop_if_not_finite(loss, step, writer, ckpt.directory, last_saved)
    step_times.append(dt)
    losses.append(loss)
    scalars = steps_lib.scalars(m, learning_rates[step - 1], dt, unit, items_per_step)
    scalars.update(balance_scalars)
    if (keep := balancer.setup(step - 1).keep) is not None:
      scalars.update({"resize/min_keep": min(keep),
                      "resize/resized_devices": sum(k < 1 for k in keep)})
    if step % run.eval_every == 0 or step == run.steps:
      val = steps_lib.evaluate(engine, state.params, eval_batches, plan)
      scalars.update(val)
    decision = balancer.decision
    if decision is not None and decision.changed:
      say(f"balance step {step}: {decision.reason}")
    if (step % run.log_every == 0 or step == run.steps or "val/loss" in scalars
        or (decision is not None and decision.changed)):
      steps_lib.record(writer, progress, step, dt, items_per_step, scalars)
    if (run.checkpoint_every and step % run.checkpoint_every == 0) or step == run.steps:
      meta = {"data_position": step, "layout": balancer.layout.to_json(),
              "model": run.model.to_dict()}
      state = _save(ckpt, engine, balancer, state, step, meta)
      last_saved = step
  summary = dict(steps_lib.summary(run, start, step_times, losses, val),
                 balance=balancer.summary(float(np.sum(step_times))))
  b = summary["balance"]
  say(f"done: {len(step_times)} steps, {summary[f'{unit}_per_s']:,.0f} {unit}/s, "
      f"val_loss {val.get('val/loss', float('nan')):.4f}, {b['migrations']} migrations, "
      f"{b['compiles_after_warmup']} compiles after warm-up")
  return summary
