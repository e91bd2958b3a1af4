"""`train_and_evaluate(config, workdir)`: the entry behind experiments/train.py.

It validates the config (the only place the raw config is read), answers a run with nothing
left to train from its workdir, and hands the rest to the training loop (`trainer.Trainer`,
whose doc says the order of work) with the run's executor: tensor-parallel (`tensor`) or,
for a pipelined or planned run, pipelined (`pipelined`); in a replica sync mode, that one
wrapped in the replicas' (`replicas`; with several processes, one replica each:
`replica_processes`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Sequence

import jax

from semijax.core import barrier
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import executor as executor_lib
from semijax.train import metrics as metrics_lib
from semijax.train import pipeline_setup
from semijax.train import pipelined
from semijax.train import preemption
from semijax.train import replica_processes
from semijax.train import replicas
from semijax.train import steps as steps_lib
from semijax.train import tensor
from semijax.train import trainer as trainer_lib


say = metrics_lib.say
build_engine = tensor.build_engine          # the names callers of the entry use
build_emulator = tensor.build_emulator


def _already_trained(run: config_lib.RunConfig, workdir: str) -> dict | None:
  """The summary of a run with nothing left to do (its workdir's newest intact checkpoint is of
  this model at config.steps or later), said on the console; None if there is training to do."""
  directory = os.path.join(workdir, "checkpoints")
  found = os.path.isdir(directory)
  # No process creates the folder (its trainer's checkpointer) before every process has looked:
  # else one would open a checkpointer here that the others do not, and wait alone at its
  # barrier.
  barrier.wait_for_all("looked for a finished run")
  if not found:
    return None
  ckpt = checkpoint_lib.Checkpointer(directory, keep=run.keep_checkpoints)
  try:
    step = ckpt.latest_intact_step()      # the trainer says which were damaged
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
                       engine_cache: dict | None = None,
                       hooks: Sequence[executor_lib.Hook] = ()) -> dict:
  """Trains `config` in `workdir` (auto-resuming) and returns a summary of the run.

  Args:
    config: the run's ConfigDict (validated here, the only place it is read).
    workdir: where checkpoints, metrics and decisions go.
    after_warmup: called once everything is compiled, right before the first step (e.g. a
      benchmark starts its contention there).
    engine_cache: a dict to reuse engines (and their compiled steps) across runs in one process
      whose model, mesh, optimizer and emulation settings match (benchmarks).
    hooks: called after every step (a replica mode's update) with the step and its scalars
      (`executor.Hook`).

  Returns:
    {"steps", "train/loss", "val/loss", "val/accuracy", "mean_step_time_s", "<unit>_per_s",
     "step_times_s": [...], "losses": [...], "balance": {...}} for the steps run by this call;
    {..., "already_trained": True} and no steps if the workdir's checkpoint is at config.steps;
    {..., "preempted": step} if a SIGTERM stopped it (it saved a checkpoint at that step).

  Raises:
    ConfigError: bad config or data (before compiling).
    FloatingPointError: a NaN or infinite loss (the last good checkpoint stays intact).
  """
  run = config_lib.validate(config, jax.device_count(), jax.process_count())
  if (done := _already_trained(run, workdir)) is not None:
    return done
  with contextlib.ExitStack() as stack:
    if run.pipeline is not None:
      run, executor = pipelined.prepare(run, workdir)
    else:
      executor = tensor.TensorParallel(run, workdir, engine_cache)
    stack.callback(executor.close)
    if run.sync.mode != "sync":     # replicas that do not step together
      executor = _replicas(run, executor, workdir)
    # Processes that do not step together stop where their executor says (it hears the SIGTERM).
    stop = stack.enter_context(preemption.Preemption(by_process=executor.own_checkpoints))
    if executor.own_checkpoints:
      executor.preemption, stop = stop, None
    loop = trainer_lib.Trainer(run, workdir, executor, stack, hooks, stop)
    return loop.train(after_warmup)


def _replicas(run: config_lib.RunConfig, executor, workdir: str):
  """The replica-mode executor around a tensor-parallel or pipelined one: one replica per
  process when there are several processes (tensor-parallel), else the emulated replicas of
  this one."""
  if run.pipeline is None and jax.process_count() > 1:
    return replica_processes.ProcessReplicas(run, executor, workdir)
  if isinstance(executor, pipelined.Pipelined):
    return replicas.Replicas(run, executor, pipelined.FixedPlan(executor.setup),
                             pipeline_setup.checkpoint_meta(executor.setup.plan))
  return replicas.Replicas(run, executor, executor.balancer)
