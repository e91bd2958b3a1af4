"""The training loop (`Trainer`): what every run shares, its parallelism behind an
`executor.Executor` (tensor-parallel: `train.tensor`).

Order of work, so that bad input never costs a compile or a saved checkpoint:
  1. the entry (`loop.train_and_evaluate`) validates the whole config into a typed
     `config.RunConfig`; the executor builds the data set (file errors surface here), the mesh,
     model, optimizer and engine and what its kind adds (a balancer);
  2. `Trainer(...)` restores the latest checkpoint from workdir/checkpoints if there is one
     (the executor puts it onto the layout this run starts in, which may differ from the one it
     was saved with), else initializes from the seed; then opens the metrics;
  3. `Trainer.train` warms up (the executor compiles and exercises every program its steps may
     use), then trains.

Resume order: the workdir's own latest checkpoint always wins; otherwise start from scratch.
Each step k (1-based; it trains on global batch k - 1) is the executor's, then: the NaN stop
(the last good checkpoint stays intact); evaluation every eval_every steps and at the last; a
record (workdir/metrics.jsonl and TensorBoard on process 0, and a progress line) every
log_every steps, at every evaluation, at the last step and whenever the executor has something
to say (a balancing change); a checkpoint every checkpoint_every steps and at the last (or
where the executor says, for processes that do not step together); then the hooks
(`executor.Hook`). The host waits for a step only where it needs the step's numbers: a step
the executor let run ahead (`StepResult.seconds` None) is waited for at the next record,
evaluation, checkpoint, hook or stop, the last step included; the NaN stop then checks each
loss since, in order, before anything is evaluated or saved. Asked to stop (SIGTERM;
`preemption`, or the executor's `StepResult.stop`), the run saves a checkpoint at the next
step boundary (every process at once), says "preempted at step N" and returns; the rerun
resumes there. The console (process 0) shows where the run starts, the warm-up, the executor's
notes, progress lines and a final summary; library chatter goes to the absl log.
The checkpoint manager and the metric writer are closed on every path out (the caller's
`contextlib.ExitStack`), a NaN loss and an exception included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Callable, NamedTuple, Sequence

import jax

from semijax.errors import ConfigError
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import executor as executor_lib
from semijax.train import metrics as metrics_lib
from semijax.train import preemption as preemption_lib
from semijax.train import profile as profile_lib
from semijax.train import steps as steps_lib

say = metrics_lib.say


class _Ahead(NamedTuple):
  """A step the loop has not waited for: its 1-based number, result and samples."""
  step: int
  result: executor_lib.StepResult
  samples: int


class Trainer:
  """One run's loop over the steps of an executor, from its resume point to `run.steps`.

  Args:
    run: the validated run.
    workdir: where checkpoints (workdir/checkpoints) and metrics go.
    executor: the run's parallelism (built, not yet initialized).
    stack: closes the checkpoint manager and the metric writer when the caller is done.
    hooks: called after every step (`executor.Hook`).
    preemption: tells at each step boundary whether to save and stop (None: never).

  Attributes:
    ckpt, writer, progress: the run's checkpointer, metric writer and progress line; start:
    the step it resumes after (0: from the seed); samples: the examples trained by then.
    trace, throughput: the profiler trace of `config.profile` and each step's TFLOP/s and MFU.
  """

  def __init__(self, run: config_lib.RunConfig, workdir: str, executor: executor_lib.Executor,
               stack: contextlib.ExitStack, hooks: Sequence[executor_lib.Hook] = (),
               preemption: preemption_lib.Preemption | None = None):
    self.run, self.executor, self.hooks = run, executor, tuple(hooks)
    self.preemption = preemption
    self.ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                            keep=run.keep_checkpoints)
    stack.callback(self.ckpt.close)
    self.start, self.samples = self._restore_or_init()
    self.writer = stack.enter_context(metrics_lib.MetricWriter(workdir, resume_step=self.start))
    self.writer.write_config(run.source)
    self.progress = metrics_lib.Progress(run.steps, unit=run.model.unit, start_step=self.start)
    self.trace = profile_lib.Trace(run.profile, self.writer.tensorboard_dir)
    stack.callback(self.trace.close)
    self.throughput = profile_lib.Throughput(run.model, run.profile.peak_tflops)

  def _restore_or_init(self) -> tuple[int, int]:
    """(the step the run continues after, the samples trained by then): the newest intact
    checkpoint's data position and samples (newer damaged ones said and set aside), or (0, 0)
    with the executor initialized from the seed.

    Raises:
      ConfigError: no checkpoint is intact; the checkpoint holds another model, or one the
        executor cannot continue.
    """
    run, ckpt = self.run, self.ckpt
    if ckpt.latest_step() is None:
      self.executor.init(run.seed)
      return 0, 0
    damaged = []
    step = ckpt.latest_intact_step(lambda s, problem: damaged.append((s, problem)))
    if step is None:
      found = "; ".join(f"step {s}: {problem}" for s, problem in damaged)
      raise ConfigError(f"--workdir: no intact checkpoint in {ckpt.directory} ({found}); move "
                        "the folder aside or use another --workdir")
    for s, problem in damaged:
      where = ckpt.set_aside(s)
      say(f"checkpoint step {s} in {ckpt.directory} is damaged ({problem}): not loaded, set "
          f"aside in {where}")
    meta = ckpt.read_meta(step)
    if meta.get("model") != run.model.to_dict():
      raise ConfigError(
          f"config.model: the checkpoint at step {step} in {ckpt.directory} was trained with "
          f"model {meta.get('model')}, not {run.model.to_dict()}; use another --workdir")
    checkpoint_lib.check_loss_scale(meta, run.optimizer.loss_scale, step, ckpt.directory)
    start, saved_with = self.executor.restore(ckpt, step, meta)
    say(f"resumed from step {step} ({ckpt.directory}/{step}, saved with {saved_with}), "
        f"continuing to step {run.steps}")
    return start, int(meta.get("samples", start * run.batch_size))

  def train(self, after_warmup: Callable[[], None] | None = None) -> dict:
    """Warms up, runs steps from start + 1 until their samples make the run's budget (steps
    x batch_size; `run.steps` steps of a global batch each) or the run is preempted, and
    returns the summary (`steps.summary`'s keys and the executor's; "preempted": the step it
    saved and stopped at, if it was).

    Args:
      after_warmup: called once everything is compiled, right before the first step.

    Raises:
      FloatingPointError: a NaN or infinite loss.
    """
    run, executor = self.run, self.executor
    batch, budget = run.batch_size, run.steps * run.batch_size
    learning_rates = steps_lib.learning_rates(run)
    t0 = time.perf_counter()
    compiled = executor.warm_up(self.start)
    steps_lib.start_together("semijax warm-up")
    say(f"warm-up: {compiled}, {time.perf_counter() - t0:.1f} s")
    if after_warmup is not None:
      after_warmup()
    tally = steps_lib.Tally(run)
    step, applied = self.start, self.samples
    next_eval = (applied // (run.eval_every * batch) + 1) * run.eval_every
    ahead: list[_Ahead] = []      # steps not yet waited for, in order
    since = 0.0                   # when the first of them began (set as it begins)
    while applied < budget:
      step += 1
      if not ahead:
        since = time.perf_counter()
      self.trace.before(step)
      result = executor.step(step - 1)
      self.trace.after(step)
      rate = learning_rates[min(applied // batch, run.steps - 1)]
      samples = batch if result.samples is None else result.samples
      applied += samples
      ahead.append(_Ahead(step, result, samples))
      last = applied >= budget
      evaluate = result.evaluable and (applied >= next_eval * batch or last)
      preempted = result.stop or (self.preemption is not None and
                                  self.preemption.reached(step) and not last)
      save_as = result.checkpoint if executor.own_checkpoints else (
          step if (run.checkpoint_every and step % run.checkpoint_every == 0) or last or
          preempted else None)
      if (result.seconds is None and not (last or evaluate or preempted or result.notes) and
          save_as is None and step % run.log_every and not self.hooks):
        continue                                # runs ahead: nothing here needs its numbers
      result = self._settle(ahead, since, tally)
      ahead = []
      scalars = self._scalars(result, rate, samples)
      if evaluate:
        if val := executor.evaluate():          # {}: deferred (one replica per process)
          tally.val = val
          scalars.update(val)
        while next_eval * batch <= applied:
          next_eval += run.eval_every
      self._record(step, result, scalars, applied, last)
      if save_as is not None:
        executor.save(self.ckpt, save_as, {"data_position": step, "samples": applied,
                                           "model": run.model.to_dict(),
                                           "loss_scale": run.optimizer.loss_scale})
      for hook in self.hooks:
        hook(step, scalars)
      if preempted:
        say(f"preempted at step {step}: saved {self.ckpt.folder(save_as)}; rerun the same "
            "command to continue")
        return dict(self._summary(tally, "stopped"), preempted=step)
    return self._summary(tally)

  def _settle(self, ahead: list[_Ahead], since: float, tally: steps_lib.Tally
              ) -> executor_lib.StepResult:
    """Waits for the steps in `ahead` (one fetch of their metrics), stops at the first
    non-finite loss (`steps.stop_if_not_finite`), tallies each and returns the last one's
    result with host numbers. A step the executor waited for alone keeps its own seconds;
    steps that ran ahead share the wall time since `since` equally."""
    fetched = jax.device_get([a.result.metrics for a in ahead])
    alone = len(ahead) == 1 and ahead[0].result.seconds is not None
    share = ahead[0].result.seconds if alone else (time.perf_counter() - since) / len(ahead)
    for a, metrics in zip(ahead, fetched):
      metrics = {k: None if v is None else float(v) for k, v in metrics.items()}
      loss = metrics.get("loss")
      if loss is not None:
        steps_lib.stop_if_not_finite(loss, a.step, self.writer, self.ckpt)
      tally.add(share, a.samples, loss)
    return dataclasses.replace(ahead[-1].result, metrics=metrics, seconds=share)

  def _scalars(self, result: executor_lib.StepResult, learning_rate: float, samples: int
               ) -> dict:
    run = self.run
    return dict(steps_lib.scalars(result.metrics, learning_rate, result.seconds, run.model.unit,
                                  samples * run.model.items_per_example),
                **self.throughput.scalars(samples, result.seconds), **result.scalars)

  def _record(self, step: int, result: executor_lib.StepResult, scalars: dict, applied: int,
              last: bool) -> None:
    """The executor's notes, then the step's record and progress line when one is due."""
    run = self.run
    for note in result.notes:
      say(note)
    if step % run.log_every == 0 or last or "val/loss" in scalars or result.notes:
      samples = run.batch_size if result.samples is None else result.samples
      batches = applied / run.batch_size if self.executor.step_name == "update" else None
      steps_lib.record(self.writer, self.progress, step, result.seconds,
                       samples * run.model.items_per_example, scalars, batches)

  def _summary(self, tally: steps_lib.Tally, verb: str = "done") -> dict:
    unit, name = self.run.model.unit, self.executor.step_name
    base = tally.summary(self.start)
    finish = self.executor.summary(base)
    summary = dict(base, **finish.keys)
    say(f"{verb}: {len(base['step_times_s'])} {name}s, {summary[f'{unit}_per_s']:,.0f} {unit}/s"
        f"{finish.before_val}, val_loss {tally.val.get('val/loss', float('nan')):.4f}"
        f"{finish.after_val}")
    return summary
