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

import math
import os
import time

import jax
import numpy as np
from absl import logging

from semijax import checkpoint as checkpoint_lib
from semijax import config_lib
from semijax import data as data_lib
from semijax import engine as engine_lib
from semijax import hetero
from semijax import mesh as mesh_lib
from semijax import metrics as metrics_lib
from semijax import models
from semijax import priority as priority_lib


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


class ResizeDriver:
  """Chooses, before every step, the plan of a run with ZERO-resizing (config.resize).

  Keep ratios come from `ResizeSpec.keep_ratios`; priority scores are refreshed every
  `refresh_every` steps from the logical parameters; a new plan is built only when the keep
  ratios or the scores change (the compiled step is reused: the plan is data).
  """

  def __init__(self, spec, engine, layout, slowdown, config, steps_per_epoch: int):
    self.spec, self.engine, self.layout, self.slowdown = spec, engine, layout, slowdown
    self.epoch_steps = spec.epoch_steps or steps_per_epoch
    self.refresh_every = spec.refresh_every or self.epoch_steps
    m = config.model
    self.priority = priority_lib.Priority(
        spec, num_layers=m.num_layers, d_model=m.d_model, num_units=engine.num_units,
        unit_sizes=engine.unit_sizes, num_devices=layout.num_devices, seed=config.seed)
    self._keep = None
    self._plan = None
    self._step = None

  def plan(self, step: int, state) -> tuple:
    """(plan, keep ratios) for 0-based `step`; `state` is the padded train state before it."""
    keep = self.spec.keep_ratios(step, self.layout.num_devices, self.epoch_steps)
    if step == self._step:
      return self._plan, keep
    self._step = step
    refresh = step % self.refresh_every == 0
    if refresh:
      params = jax.device_get(self.engine.to_logical(state, self.layout).params)
      self.priority.refresh(params, self.engine.axes, self.layout)
    if refresh or keep != self._keep or self._plan is None:
      self._keep = keep
      self._plan = self.engine.plan(self.layout, self.slowdown,
                                    self.priority.select(self.layout, keep))
    return self._plan, keep


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
  for b in batches:
    terms = engine.eval_terms(params, b, plan)
    totals = terms if totals is None else jax.tree.map(lambda a, c: a + c, totals, terms)
  totals = jax.device_get(totals)
  return {"val/loss": float(totals["loss_sum"] / totals["count"]),
          "val/accuracy": float(totals["correct"] / totals["count"])}


def train_and_evaluate(config, workdir: str) -> dict:
  """Trains `config` in `workdir` (auto-resuming) and returns a summary of the run.

  Returns:
    {"steps", "train/loss", "val/loss", "val/accuracy", "mean_step_time_s", "<unit>_per_s",
     "step_times_s": [...], "losses": [...]} for the steps run by this call.

  Raises:
    config_lib.ConfigError: bad config or data (before compiling).
    FloatingPointError: a NaN or infinite loss (the last good checkpoint stays intact).
  """
  parsed = config_lib.validate(config, jax.device_count(), jax.process_count())
  dataset = data_lib.build(config, jax.process_index(), jax.process_count())
  engine = build_engine(config, parsed)
  layout = parsed.layout
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                     keep=config.keep_checkpoints)
  state, start = _restore_or_init(engine, ckpt, config, layout)
  writer = metrics_lib.MetricWriter(workdir, resume_step=start)
  writer.write_config(config)

  plan = engine.plan(layout, parsed.slowdown)
  resizer = None
  if parsed.resize is not None:
    resizer = ResizeDriver(parsed.resize, engine, layout, parsed.slowdown, config,
                           dataset.steps_per_epoch)
    if start and (saved := ckpt.restore_extra(start)) is not None:
      resizer.priority.load_state_dict(saved["priority"])
    plan, _ = resizer.plan(start, state)
  eval_batches = [engine.shard_batch(b) for b in dataset.eval_batches()]
  engine.compile(state, engine.shard_batch(dataset.train_batch(start)), plan, eval_batches[0])

  unit = "tokens" if config.model.name == "gpt" else "images"
  items_per_step = config.batch_size * dataset.tokens_per_example
  schedule = config_lib.learning_rate_schedule(config)
  progress = metrics_lib.Progress(config.steps, unit=unit, start_step=start)
  step_times, losses, val = [], [], {}
  last_saved = start if start else None
  for step in range(start + 1, config.steps + 1):
    batch = engine.shard_batch(dataset.train_batch(step - 1))
    keep = None
    if resizer is not None:
      plan, keep = resizer.plan(step - 1, state)
    t0 = time.perf_counter()
    state, m = engine.train_step(state, batch, plan)
    loss = float(m["loss"])                          # waits for the step
    dt = time.perf_counter() - t0
    if not math.isfinite(loss):
      writer.write(step, {"train/loss": loss})
      writer.close()
      raise FloatingPointError(
          f"train/loss is {loss} at step {step}: training stopped. The last good checkpoint "
          f"(step {last_saved}) in {ckpt.directory} is intact; lower "
          "config.optimizer.learning_rate or check the data.")
    step_times.append(dt)
    losses.append(loss)
    scalars = {"train/loss": loss, "train/accuracy": float(m["accuracy"]),
               "train/grad_norm": float(m["grad_norm"]),
               "train/learning_rate": float(schedule(step - 1)),
               "train/step_time_s": dt, f"train/{unit}_per_s": items_per_step / dt}
    if keep is not None:
      scalars.update({"resize/min_keep": min(keep), "resize/resized_devices": sum(
          k < 1 for k in keep)})
    if step % config.eval_every == 0 or step == config.steps:
      val = _evaluate(engine, state.params, eval_batches, plan)
      scalars.update(val)
    if step % config.log_every == 0 or step == config.steps or "val/loss" in scalars:
      writer.write(step, scalars)
      if jax.process_index() == 0:
        names = {"train/loss": "loss", "val/loss": "val_loss", "val/accuracy": "val_accuracy"}
        shown = {names[k]: v for k, v in scalars.items() if k in names}
        print(progress.line(step, dt, items_per_step, shown), flush=True)
    if (config.checkpoint_every and step % config.checkpoint_every == 0) or step == config.steps:
      meta = {"data_position": step, "layout": layout.to_json(),
              "model": config.model.to_dict()}
      extra = None if resizer is None else {"priority": resizer.priority.state_dict()}
      ckpt.save(step, engine.to_logical(state, layout), meta, extra)
      last_saved = step
  writer.close()
  ckpt.close()
  timed = step_times[1:] or step_times
  mean_dt = float(np.mean(timed)) if timed else float("nan")
  return {"steps": config.steps, "start_step": start,
          "train/loss": losses[-1] if losses else float("nan"), **val,
          "mean_step_time_s": mean_dt, f"{unit}_per_s": items_per_step / mean_dt,
          "step_times_s": step_times, "losses": losses}
