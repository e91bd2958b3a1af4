"""What every training loop does around a step: stop on a non-finite loss, the step's scalars,
the metric record and console line, and the run's summary (`trainer`, `replica_processes`)."""

from __future__ import annotations

import logging
import math

import jax
import numpy as np

from semijax.core import barrier
from semijax.core import transport
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib

CONSOLE_NAMES = {"train/loss": "loss", "val/loss": "val_loss", "val/accuracy": "val_accuracy",
                 "train/mfu": "mfu"}


def start_together(name: str) -> None:
  """Waits for every process after the warm-up (a process still compiling would stall the
  first step's collectives); then, on CPU, lets the steps' threads run before the threads of
  the collectives' transport, which the warm-up started (`core.transport`). Nothing with one
  process."""
  if jax.process_count() > 1:
    barrier.wait_for_all(name)
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


def stop_if_not_finite(loss: float, step: int, writer, ckpt) -> None:
  """Records a NaN or infinite loss and raises FloatingPointError naming the newest checkpoint
  of `ckpt` (a `checkpoint.Checkpointer`) that verifies."""
  if math.isfinite(loss):
    return
  writer.write(step, {"train/loss": loss})
  intact = ckpt.latest_intact_step(collective=False)   # a replica process may stop alone
  saved = (f"The last good checkpoint (step {intact}) in {ckpt.directory} is intact"
           if intact is not None else "No intact checkpoint was saved yet")
  raise FloatingPointError(
      f"train/loss is {loss} at step {step}: training stopped. {saved}; lower "
      "config.optimizer.learning_rate or check the data.")


def scalars(metrics: dict, learning_rate: float, seconds: float, unit: str, items: float
            ) -> dict:
  """The scalars of one train step (`metrics`: the step's loss, accuracy, grad_norm and, under
  dynamic loss scaling, loss_scale; one it did not measure missing or None) that trained
  `items` tokens or images."""
  out = {f"train/{k}": float(metrics[k]) for k in ("loss", "accuracy", "grad_norm",
                                                   "loss_scale")
         if metrics.get(k) is not None}
  out.update({"train/learning_rate": float(learning_rate), "train/step_time_s": seconds,
              f"train/{unit}_per_s": items / seconds})
  return out


def record(writer, progress: metrics_lib.Progress, step: int, seconds: float, items: float,
           values: dict, batches: float | None = None) -> None:
  """Writes `values` for `step` (which trained `items`) and prints its progress line (an
  update's, with the global `batches` trained by it, when given)."""
  writer.write(step, values)
  shown = {CONSOLE_NAMES[k]: v for k, v in values.items() if k in CONSOLE_NAMES}
  metrics_lib.say(progress.line(step, seconds, items, shown, batches))


def summary(run, start: int, step_times: list, losses: list, val: dict,
            samples: list | None = None) -> dict:
  """The keys every loop returns: steps (the last one), start_step, train/loss, the last
  validation, mean_step_time_s and <unit>_per_s (the first step left out), step_times_s,
  losses. `samples`: the examples of each step (default: a global batch each)."""
  unit = run.model.unit
  samples = [run.batch_size] * len(step_times) if samples is None else samples
  timed, counted = (step_times[1:], samples[1:]) if len(step_times) > 1 else (step_times, samples)
  mean_dt = float(np.mean(timed)) if timed else float("nan")
  rate = (sum(counted) * run.model.items_per_example / float(np.sum(timed)) if timed
          else float("nan"))
  return {"steps": start + len(step_times), "start_step": start,
          "train/loss": losses[-1] if losses else float("nan"), **val,
          "mean_step_time_s": mean_dt, f"{unit}_per_s": rate,
          "step_times_s": step_times, "losses": losses}


class Tally:
  """A run's step times, samples and measured losses as its steps come, and its last
  validation (`val`); `summary` makes the keys every loop returns of them."""

  def __init__(self, run):
    self.run = run
    self.step_times: list[float] = []
    self.samples: list[int] = []
    self.losses: list[float] = []
    self.val: dict = {}

  def add(self, seconds: float, samples: int, loss: float | None) -> None:
    self.step_times.append(seconds)
    self.samples.append(samples)
    if loss is not None:
      self.losses.append(loss)

  def summary(self, start: int) -> dict:
    return summary(self.run, start, self.step_times, self.losses, self.val, self.samples)
