"""The interface between the training loop (`train.trainer`) and a kind of parallelism.

An `Executor` holds one run's engine, its train state (padded, on the devices), its data and
whatever the kind adds (a balancing policy, a pipeline plan, an emulation); the loop drives it:
initialize or restore, warm up, step, evaluate, save, summarize, close. The loop owns what every
run shares (the step count and resume point, the evaluation and checkpoint cadence, metrics,
the NaN stop, the progress line, the summary, per-step hooks); an executor owns only how a step
is computed. `StepResult` and `Finish` are what it hands back. The kinds: tensor-parallel
(`tensor.TensorParallel`), pipelined (`pipelined.Pipelined`), the replica modes in one process
(`replicas.Replicas`, around either) and with one replica per process
(`replica_processes.ProcessReplicas`).

A `Placement` says where a replica mode's units are for each update: the tensor-parallel
balancer (`balance.coordinator.Balancer`) or a pipelined run's fixed plan
(`pipelined.FixedPlan`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol, runtime_checkable

from semijax.train import checkpoint as checkpoint_lib


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What one step did, as host numbers.

  Attributes:
    metrics: the step's "loss", "accuracy" and "grad_norm" (floats, or scalars on the devices
      for a step that ran ahead; the loop makes the train scalars of them); one the step did
      not measure is missing or None (a replica mode's update that started no gradient has no
      loss).
    seconds: the step's wall time and everything the kind counts with it (a migration, an
      emulated straggler's sleep); None for a step that ran ahead (dispatched, not waited
      for; it applied one global batch): the loop waits for it where it needs its numbers (a
      record, an evaluation, a checkpoint, the last step), and the steps since the last wait
      share the time until then.
    scalars: the kind's own scalars for the step's record ("balance/...", "pipeline/...").
    notes: console lines the step calls for (a balancing change); a step with notes is
      recorded whatever `log_every` says.
    samples: the examples the step applied (None: one global batch; a replica mode's update
      may apply fewer).
    evaluable: whether the parameters after the step are the model to validate (local_sgd's
      are only at an average).
    checkpoint: for an executor with `own_checkpoints`, the id to save a checkpoint under
      after this step (the same on every process), or None for none.
    stop: for an executor with `own_checkpoints`, the run stops after this step's checkpoint
      (it was asked to: preempted).
  """

  metrics: dict
  seconds: float
  scalars: dict = dataclasses.field(default_factory=dict)
  notes: tuple[str, ...] = ()
  samples: int | None = None
  evaluable: bool = True
  checkpoint: int | None = None
  stop: bool = False


@dataclasses.dataclass(frozen=True)
class Finish:
  """The kind's part of a run's summary: `keys` join the summary dict; `before_val` and
  `after_val` are clauses of the final "done: ..." console line around its val_loss."""

  keys: dict
  before_val: str = ""
  after_val: str = ""


@runtime_checkable
class Executor(Protocol):
  """One kind of parallelism behind the training loop (see module doc).

  Steps are 0-based here (step k trains on global batch k; a replica mode's update k on what
  its round rule gives); the loop counts from 1 and runs until the steps' samples make the
  run's budget (steps x batch_size).

  Attributes:
    step_name: what a step is called on the console: "step", or "update" where steps apply
      unequal samples (the replica modes).
    own_checkpoints: whether the executor says when to save (`StepResult.checkpoint`), for
      processes that do not step together (ssaw / async with one replica per process); else
      the loop saves every checkpoint_every steps, at the last and when preempted, under the
      step.
  """

  step_name: str
  own_checkpoints: bool

  def init(self, seed: int) -> None:
    """Initializes the train state from `seed` (a run with no checkpoint)."""

  def restore(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> tuple[int, str]:
    """Restores the checkpoint at `step` (its `meta` already read; the model already checked
    against it) onto this run's layout.

    Returns:
      (the data position to continue from, what the resume line says the checkpoint was saved
      with, e.g. "MLP units (16, 16, 16, 16)" and a dtype-change clause).

    Raises:
      ConfigError: the checkpoint was saved by a run this kind cannot continue (named field).
    """

  def warm_up(self, step: int) -> str:
    """Compiles (and exercises) every program the steps from 0-based `step` on may run; returns
    what the warm-up line says of it (e.g. "policy static, 2 step programs compiled")."""

  def step(self, step: int) -> StepResult:
    """Trains 0-based `step` on global batch `step`; waits for it, or lets it run ahead
    (`StepResult.seconds` None)."""

  def evaluate(self) -> dict:
    """{"val/loss", "val/accuracy"} of the current parameters over every evaluation batch, or
    {} where validation waits for the end (one replica per process: a copy is kept now)."""

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> None:
    """Checkpoints the train state (and the kind's host state) as `step`; `meta` (data
    position, model) gets the kind's own facts added (its layout, plan)."""

  def summary(self, base: dict) -> Finish:
    """The kind's part of the summary, given the loop's (`steps.summary`) `base`."""

  def close(self) -> None:
    """Releases what the executor opened (decision logs); called on every path out."""


Hook = Callable[[int, dict], None]
"""Called by the loop after every step with the 1-based step and the step's scalars (the
record's, written or not)."""


@runtime_checkable
class Placement(Protocol):
  """Where the units of a replica mode's engine are for each update (`replicas.Replicas`).

  Attributes:
    layout: the current layout (`core.layout.Layout`, or a pipelined `PipeLayout`).
    emulator: the emulated slowdown, or None (then every replica's time unit is 1 s of nothing).
    delay_s: emulated seconds of a replica's share of the current step (a float, or [R]).
    compiles_at_warmup: the process's compile count once everything was warm (None before).
  """

  layout: Any
  emulator: Any
  delay_s: Any
  compiles_at_warmup: int | None

  def warm_up(self, state, batch, eval_batch, step: int = 0):
    """Compiles what the placement may run from `step` on; returns the state (maybe moved)."""

  def before_step(self, step: int, state) -> tuple[Any, Any]:
    """(the state on the layout for 0-based `step`, the step's plan for the engine)."""

  def after_step(self, step: int, step_s: float) -> dict:
    """Takes the step's measured seconds; returns scalars for its record."""

  def state_dict(self) -> dict | None:
    """The host state a checkpoint keeps."""

  def summary(self, total_s: float) -> dict:
    """The placement's part of the summary, given the run's total seconds."""
