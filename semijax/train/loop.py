"""`train_and_evaluate(config, workdir)`: the training loop behind experiments/train.py.

Order of work, so that bad input never costs a compile or a saved checkpoint:
  1. validate the whole config and build the data set (file errors surface here);
  2. build the mesh, model, optimizer and engine; restore the latest checkpoint from
     workdir/checkpoints if there is one (onto the *configured* layout, which may differ from the
     one it was saved with), else initialize from the seed;
  3. compile the train and eval steps ahead of time, then train.

Resume order: the workdir's own latest checkpoint always wins; otherwise start from scratch.
Metrics go to workdir/metrics.jsonl and TensorBoard files (process 0 only).
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Callable

import jax
import numpy as np
from absl import logging

from semijax import models
from semijax.balance import coordinator as balance_lib
from semijax.core import emulation as hetero
from semijax.core import engine as engine_lib
from semijax.core import mesh as mesh_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import metrics as metrics_lib


def build_engine(config, parsed: config_lib.Parsed) -> engine_lib.Engine:
  """The engine for `config` (model, optimizer, mesh, emulated slowdown costs)."""
  mesh = mesh_lib.make_mesh(config.mesh.data, config.mesh.tensor)
  model_fn, loss_terms = models.build(config.model)
  unit_ms = None
  if parsed.slowdown is not None:
    m = config.model
    flops = hetero.flops_per_unit(d_model=m.d_model, head_dim=m.d_model // m.num_heads,
                                  seq_len=models.sequence_length(m), causal=models.is_causal(m))
    tokens = config.batch_size // config.mesh.data * models.sequence_length(m)
    unit_ms = hetero.unit_ms(flops, tokens, config.hetero.device_gflops)
  return engine_lib.Engine(model_fn, loss_terms, mesh, config_lib.optimizer(config),
                           unit_ms=unit_ms)


def _restore_or_init(engine, ckpt, config, layout):
  """(padded state, start step) from the latest checkpoint in workdir, or fresh from the seed."""
  step = ckpt.latest_step()
  if step is None:
    return engine.init(config.seed, layout), 0
  meta = ckpt.read_meta(step)
  if meta.get("model") != config.model.to_dict():
    raise config_lib.ConfigError(
        f"config.model: the checkpoint at step {step} in {ckpt.directory} was trained with model "
        f"{meta.get('model')}, not {config.model.to_dict()}; use another --workdir")
  logical, meta = ckpt.restore(engine.abstract_logical(), step)
  logging.info("restored step %d (saved with layout %s) onto layout %s", step,
               meta["layout"], layout.to_json())
  return engine.to_padded(logical, layout), int(meta["data_position"])


def _evaluate(engine, params, batches, plan) -> dict:
  totals = None
  for b in batches:    # summed on the host: adding device scalars would compile on the way
    terms = jax.device_get(engine.eval_terms(params, b, plan))
    totals = terms if totals is None else jax.tree.map(lambda a, c: a + c, totals, terms)
  return {"val/loss": float(totals["loss_sum"] / totals["count"]),
          "val/accuracy": float(totals["correct"] / totals["count"])}


def train_and_evaluate(config, workdir: str, *, after_warmup: Callable[[], None] | None = None,
                       engine_cache: dict | None = None) -> dict:
  """Trains `config` in `workdir` (auto-resuming) and returns a summary of the run.

  Args:
    config: the run's ConfigDict; workdir: where checkpoints, metrics and decisions go.
    after_warmup: called once everything is compiled, right before the first step (e.g. a
      benchmark starts its contention there).
    engine_cache: a dict to reuse engines (and their compiled steps) across runs in one process
      whose model, mesh, optimizer and emulation settings match (benchmarks).

  Returns:
    {"steps", "train/loss", "val/loss", "val/accuracy", "mean_step_time_s", "<unit>_per_s",
     "step_times_s": [...], "losses": [...]} for the steps run by this call.

  Raises:
    config_lib.ConfigError: bad config or data (before compiling).
    FloatingPointError: a NaN or infinite loss (the last good checkpoint stays intact).
  """
  parsed = config_lib.validate(config, jax.device_count(), jax.process_count())
  feed_index, feeds = mesh_lib.batch_feed(mesh_lib.make_mesh(config.mesh.data, config.mesh.tensor))
  dataset = data_lib.build(config, feed_index, feeds)
  if engine_cache is None:
    engine = build_engine(config, parsed)
  else:
    key = json.dumps({k: config[k].to_dict() for k in ("model", "mesh", "optimizer", "hetero")}
                     | {"steps": config.steps, "batch_size": config.batch_size}, sort_keys=True)
    if key not in engine_cache:
      engine_cache[key] = build_engine(config, parsed)
    engine = engine_cache[key]
  layout = balance_lib.Balancer.initial_layout(config, parsed)
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     keep=config.keep_checkpoints)
  state, start = _restore_or_init(engine, ckpt, config, layout)
  writer = metrics_lib.MetricWriter(workdir, resume_step=start)
  writer.write_config(config)

  # The schedule in one program, before warm-up (calling it per step would compile on the way).
  learning_rates = np.asarray(jax.jit(jax.vmap(config_lib.learning_rate_schedule(config)))(
      np.arange(config.steps)))
  balancer = balance_lib.Balancer(config, parsed, engine, layout, workdir,
                                  dataset.steps_per_epoch)
  if start and balancer.priority is not None and (saved := ckpt.restore_extra(start)) is not None:
    balancer.priority.load_state_dict(saved["priority"])
  eval_batches = [engine.shard_batch(b) for b in dataset.eval_batches()]
  state = balancer.warm_up(state, engine.shard_batch(dataset.train_batch(start)), eval_batches[0],
                          step=start)
  if jax.process_count() > 1:     # start together (a process still compiling would stall step 1)
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices("semijax warm-up")
  if after_warmup is not None:
    after_warmup()

  unit = "tokens" if config.model.name == "gpt" else "images"
  items_per_step = config.batch_size * dataset.tokens_per_example
  progress = metrics_lib.Progress(config.steps, unit=unit, start_step=start)
  step_times, losses, val = [], [], {}
  last_saved = start if start else None
  for step in range(start + 1, config.steps + 1):
    batch = engine.shard_batch(dataset.train_batch(step - 1))
    t0 = time.perf_counter()
    state, plan = balancer.before_step(step - 1, state)   # may migrate the state
    t1 = time.perf_counter()
    state, m = engine.train_step(state, batch, plan)
    loss = float(m["loss"])                          # waits for the step
    balance_scalars = balancer.after_step(step - 1, time.perf_counter() - t1)
    dt = time.perf_counter() - t0                    # the step and everything balancing costs
    if not math.isfinite(loss):
      writer.write(step, {"train/loss": loss})
      writer.close()
      balancer.close()
      raise FloatingPointError(
          f"train/loss is {loss} at step {step}: training stopped. The last good checkpoint "
          f"(step {last_saved}) in {ckpt.directory} is intact; lower "
          "config.optimizer.learning_rate or check the data.")
    step_times.append(dt)
    losses.append(loss)
    scalars = {"train/loss": loss, "train/accuracy": float(m["accuracy"]),
               "train/grad_norm": float(m["grad_norm"]),
               "train/learning_rate": float(learning_rates[step - 1]),
               "train/step_time_s": dt, f"train/{unit}_per_s": items_per_step / dt}
    scalars.update(balance_scalars)
    if (keep := balancer.keep(step - 1)) is not None:
      scalars.update({"resize/min_keep": min(keep), "resize/resized_devices": sum(
          k < 1 for k in keep)})
    if step % config.eval_every == 0 or step == config.steps:
      val = _evaluate(engine, state.params, eval_batches, plan)
      scalars.update(val)
    changed = balancer.decision is not None and balancer.decision.changed
    if step % config.log_every == 0 or step == config.steps or "val/loss" in scalars or changed:
      writer.write(step, scalars)
      if jax.process_index() == 0:
        names = {"train/loss": "loss", "val/loss": "val_loss", "val/accuracy": "val_accuracy"}
        shown = {names[k]: v for k, v in scalars.items() if k in names}
        print(progress.line(step, dt, items_per_step, shown), flush=True)
    if (config.checkpoint_every and step % config.checkpoint_every == 0) or step == config.steps:
      meta = {"data_position": step, "layout": balancer.layout.to_json(),
              "model": config.model.to_dict()}
      extra = None if balancer.priority is None else {"priority": balancer.priority.state_dict()}
      ckpt.save(step, engine.to_logical(state, balancer.layout), meta, extra)
      last_saved = step
  writer.close()
  ckpt.close()
  balancer.close()
  timed = step_times[1:] or step_times
  mean_dt = float(np.mean(timed)) if timed else float("nan")
  return {"steps": config.steps, "start_step": start,
          "train/loss": losses[-1] if losses else float("nan"), **val,
          "mean_step_time_s": mean_dt, f"{unit}_per_s": items_per_step / mean_dt,
          "step_times_s": step_times, "losses": losses,
          "balance": balancer.summary(float(np.sum(step_times)))}
