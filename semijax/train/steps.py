"""What every training loop does around a step: stop on a non-finite loss, the step's scalars,
the metric record and console line, and the run's summary (`trainer`, `pipelined`, the replica
loops)."""

from __future__ import annotations

import logging
import math

import jax
from jax.experimental import multihost_utils
import numpy as np

from semijax.core import transport
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib

CONSOLE_NAMES = {"train/loss": "loss", "val/loss": "val_loss", "val/accuracy": "val_accuracy"}


def start_together(name: str) -> None:
  """Waits for every process after the warm-up (a process still compiling would stall the
  first step's collectives); then, on CPU, lets the steps' threads run before the threads of
  the collectives' transport, which the warm-up started (`core.transport`). Nothing with one
  process."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
    if jax.default_backend() == "cpu":
      changed = transport.yield_to_steps()
      logging.info("collectives' transport threads %s now at nice %s", sorted(changed),
                   sorted(set(changed.values())))


def evaluate(engine, params, batches, plan) -> dict:
  """Validation loss and accuracy of `engine.eval_terms` (either engine): summed over every
  evaluation batch on the host (adding device scalars would compile on the way), divided once."""
  totals = None
  for b in batches:
    terms = jax.device_get(engine.eval_terms(params, b, plan))
    totals = terms if totals is None else jax.tree.map(lambda a, c: a + c, totals, terms)
  return {"val/loss": float(totals["loss_sum"] / totals["count"]),
          "val/accuracy": float(totals["correct"] / totals["count"])}


def learning_rates(run) -> np.ndarray:
  """float [steps]: the schedule's rate at every step, from one program before warm-up (calling
  the schedule per step would compile on the way)."""
  return np.asarray(jax.jit(jax.vmap(optimizer_lib.learning_rate_schedule(
      run.optimizer, run.steps)))(np.arange(run.steps)))


def stop_if_not_finite(loss: float, step: int, writer, checkpoint_dir: str,
                       last_saved: int | None) -> None:
  """Records a NaN or infinite loss and raises FloatingPointError saying what is intact."""
  if math.isfinite(loss):
    return
  writer.write(step, {"train/loss": loss})
  saved = (f"The last good checkpoint (step {last_saved}) in {checkpoint_dir} is intact"
           if last_saved else "No checkpoint was saved yet")
  raise FloatingPointError(
      f"train/loss is {loss} at step {step}: training stopped. {saved}; lower "
      "config.optimizer.learning_rate or check the data.")


def scalars(metrics: dict, learning_rate: float, seconds: float, unit: str,
            items_per_step: float) -> dict:
  """The scalars of one train step (`metrics`: the step's loss, accuracy, grad_norm)."""
  return {"train/loss": float(metrics["loss"]), "train/accuracy": float(metrics["accuracy"]),
          "train/grad_norm": float(metrics["grad_norm"]),
          "train/learning_rate": float(learning_rate), "train/step_time_s": seconds,
          f"train/{unit}_per_s": items_per_step / seconds}


def record(writer, progress: metrics_lib.Progress, step: int, seconds: float,
           items_per_step: float, values: dict) -> None:
  """Writes `values` for `step` and prints its progress line."""
  writer.write(step, values)
  shown = {CONSOLE_NAMES[k]: v for k, v in values.items() if k in CONSOLE_NAMES}
  metrics_lib.say(progress.line(step, seconds, items_per_step, shown))


def summary(run, start: int, step_times: list, losses: list, val: dict) -> dict:
  """The keys every loop returns: steps, start_step, train/loss, the last validation,
  mean_step_time_s (the first step left out), <unit>_per_s, step_times_s, losses."""
  unit = run.model.unit
  items_per_step = run.batch_size * run.model.items_per_example
  timed = step_times[1:] or step_times
  mean_dt = float(np.mean(timed)) if timed else float("nan")
  return {"steps": run.steps, "start_step": start,
          "train/loss": losses[-1] if losses else float("nan"), **val,
          "mean_step_time_s": mean_dt, f"{unit}_per_s": items_per_step / mean_dt,
          "step_times_s": step_times, "losses": losses}
