"""The pipelined executor (`Pipelined`): a `core.pipeline.PipelineEngine` on the mesh and
devices a plan gives (`pipeline_setup`), driven by the training loop (`trainer.Trainer`), and
`FixedPlan`, the plan in a balancer's place for the replica modes.

`prepare` resolves a run's plan (the planner's, a plan file's or the config's), says it, shapes
the run by it (its mesh and sync mode) and builds the executor. A pipelined checkpoint restores
onto another number of stages or tensor devices as well: its logical form stacks the layers in
order, then padding rows, [stages * ceil(layers / stages), ...], so another stage count reads
the same rows with fewer or more padding rows after them (and another tensor count the same
units with other zeros after them), and onto an unpipelined run (`tensor.restore_pipelined`);
an unpipelined run's checkpoint restores too, each block onto its own stage's devices
(`core.pipeline_flat`).
A replica sync mode's in-flight state is kept per stage, so such a run restores onto as many
stages only; every run onto the same sync mode.

With an emulation (`hetero.device_speeds` or `hetero.links`) every step is followed by the
emulated devices' and links' time (at the speeds of that step, `hetero.rotate_every`); the
step's measured time is that plus the real compute, and the summary says how far it is from the
plan's prediction (`planner.predict`). With `balance.policy = "semi"` the run re-plans its layers
per stage, each stage's units and its pipelines' microbatches while it trains
(`stage_balance.StageBalancer`), within compiled shapes with room to move
(`pipeline_setup.replanning_layout`, `microbatch_slots`); a checkpoint keeps the layout and
split it was saved in, and a run of the same shapes resumes in them.

With a replica sync mode (the plan's `sync`: ssaw, async or local_sgd; `pipeline_setup.for_plan`)
the pipelines are the replicas of `replicas.Replicas`, with `FixedPlan` as their
`executor.Placement`: every pipeline gets its own gradient (`PipelineEngine.replica_grads_and_terms`)
and `semijax.sync` combines them.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from semijax.core import emulation
from semijax.core import pipeline as pipeline_lib
from semijax.planner import plan as planner_plan
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import executor as executor_lib
from semijax.train import metrics as metrics_lib
from semijax.train import pipeline_setup as setup_lib
from semijax.train import prefetch as prefetch_lib
from semijax.train import stage_balance
from semijax.train import steps as steps_lib

say = metrics_lib.say


def prepare(run: config_lib.RunConfig, workdir: str | None
            ) -> tuple[config_lib.RunConfig, "Pipelined"]:
  """(the run as its plan shapes it, its executor); says the plan and writes it to
  workdir/plan.json (process 0; not without a workdir).

  Raises:
    ConfigError: the plan does not fit the devices, model or batch (named), before compiling.
  """
  plan = setup_lib.resolve_plan(run, jax.device_count())
  source = {"auto": "the planner", "": "config"}.get(run.pipeline.plan, run.pipeline.plan)
  say(f"plan ({source}):\n{planner_plan.describe(plan)}")
  run = setup_lib.for_plan(run, plan)
  if workdir is not None and jax.process_index() == 0:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "plan.json"), "w") as f:
      json.dump(plan.to_dict(), f, indent=1)
  return run, Pipelined(run, setup_lib.build(run, plan))


class Pipelined:
  """The `executor.Executor` of a pipelined run: every step runs the plan's pipeline schedule
  on the plan's fixed layout.

  Args:
    run: the validated run, shaped by its plan (`pipeline_setup.for_plan`).
    setup: its plan, engine, layout and emulation (`pipeline_setup.build`).

  Attributes:
    setup, engine, dataset: the run's (every process arranges the whole global batch);
    state: the padded train state (None before `init` or `restore`); extra: the host state a
    restore read (a replica run's in-flight state) or None; emulated: the emulated step
    (`pipeline_setup.emulated_step`) or None; balancer: the re-planning of a `semi` run
    (`stage_balance.StageBalancer`) or None; layout: the layout the state is in.
  """

  step_name = "step"
  own_checkpoints = False

  def __init__(self, run: config_lib.RunConfig, setup: setup_lib.Setup):
    self.run, self.setup, self.engine = run, setup, setup.engine
    self.dataset = data_lib.build(run.data, 0, 1)
    self.counts = setup.plan.microbatches
    self.layout = setup.layout
    self.pplan = setup.engine.plan(setup.layout, self.counts)
    self.emulated = (setup_lib.emulated_step(setup) if setup.emulator is not None else None)
    self.balancer = (stage_balance.StageBalancer(run, setup) if run.balance.policy == "semi"
                     else None)
    self.state, self.extra = None, None
    self._eval_batches = None
    self.batches: prefetch_lib.Batches = (prefetch_lib.Prefetch(self._batch) if run.run_ahead
                                          else prefetch_lib.OnTheSpot(self._batch))
    self._previous = None          # the metrics of the step dispatched last (on the devices)
    self._one_behind = setup.engine.mesh.devices.flat[0].platform == "cpu"

  def close(self) -> None:
    self.batches.close()
    if self.balancer is not None:
      self.balancer.close()

  def init(self, seed: int) -> None:
    self.state = self.engine.init(seed, self.layout)

  def restore(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> tuple[int, str]:
    """Restores onto the plan's layout, on as many stages as the checkpoint's or (without a
    replica sync mode) any other number, or from an unpipelined run's checkpoint (sync mode:
    each block read onto its own stage's devices, `PipelineEngine.stacked`); see module doc.

    Raises:
      ConfigError: the checkpoint has another sync mode, or in-flight replica state that this
        run cannot take (on another number of stages, or unpipelined).
    """
    plan, run = self.setup.plan, self.run
    saved = meta.get("pipe")
    checkpoint_lib.check_sync_mode(meta, run.sync.mode, step, ckpt.directory)
    checkpoint_lib.check_stages(meta, run.sync.mode, plan.pipe, step, ckpt.directory)
    abstract = self.engine.abstract_logical()
    if saved is None:
      flat, meta = ckpt.restore_parts(self.engine.flat_abstract(checkpoint_lib.SKIP), step)
      logical = self.engine.stacked(flat, donate=True)
      saved_with = f"unpipelined, MLP units {checkpoint_lib.unit_counts(meta, 'mlp')}"
    else:
      logical, meta = ckpt.restore(abstract, step)
      saved_with = f"layers per stage {meta['plan']['stage_layers']}"
    self._resume_in(meta.get("layout") if saved is not None else None, meta.get("microbatches"))
    self.state = self.engine.to_padded(logical, self.layout, donate=True)
    if run.sync.mode != "sync":
      self.extra = ckpt.restore_extra(step)
    return int(meta["data_position"]), saved_with + checkpoint_lib.dtype_change(meta, abstract)

  def _resume_in(self, saved: dict | None, microbatches) -> None:
    """A `semi` run resumes in the layout and microbatches per pipeline its checkpoint was saved
    in, when they fit this run's stages, pipelines and compiled shapes (else in its plan's, and
    re-plans)."""
    if self.balancer is None or saved is None:
      return
    layout = pipeline_lib.PipeLayout.from_json(saved)
    counts = tuple(microbatches or self.counts)
    if (layout.stages == self.layout.stages and layout.bucket() == self.layout.bucket()
        and len(counts) == len(self.counts) and sum(counts) == sum(self.counts)
        and max(counts) <= self.engine.microbatches):
      self.layout, self.counts = layout, counts
      self.balancer.restored(layout, counts)
      self.pplan = self.engine.plan(layout, counts)

  def _batch(self, step: int) -> tuple[tuple[int, ...], dict]:
    """(the microbatches per pipeline now, 0-based `step`'s batch arranged into them)."""
    counts = self.counts
    return counts, self.engine.arrange_batch(self.dataset.train_batch(step), counts)

  @property
  def eval_batches(self) -> list:
    """The evaluation batches, arranged into the plan's microbatches (once)."""
    if self._eval_batches is None:
      self._eval_batches = [self.engine.arrange_batch(b, self.setup.plan.microbatches)
                            for b in self.dataset.eval_batches()]
    return self._eval_batches

  def warm_up(self, step: int) -> str:
    """Compiles the train and eval programs, and a re-planning run's migrations
    (`stage_balance.StageBalancer.warm_up`)."""
    self.engine.compile(self.state, self._batch(step)[1], self.pplan, self.eval_batches[0])
    said = f"{self.engine.compile_count} step programs compiled"
    if self.balancer is not None:
      self.state, moves = self.balancer.warm_up(self.state)
      said += f", {moves} migration programs; {self.balancer.describe()}"
    return said

  def step(self, step: int) -> executor_lib.StepResult:
    """Runs 0-based `step` (its batch made while the step before ran, `prefetch.Prefetch`)
    and then the emulated devices' time. Without an emulation the step runs ahead (dispatched,
    not waited for: metrics on the devices, seconds None; the loop waits where it needs
    them), except a `semi` run's sampling step; on XLA:CPU at most two steps are in flight
    (see `tensor.TensorParallel.step`). A `semi` run may then move its state
    (`stage_balance`): the step's seconds hold the move, its notes say it."""
    counts, batch = self.batches.get(step)
    if counts != self.counts:              # made before a re-plan changed the split
      batch = self._batch(step)[1]
    plan = self.setup.plan
    t0 = time.perf_counter()
    self.state, m = self.engine.train_step(self.state, batch, self.pplan)
    scalars = {"pipeline/predicted_s": plan.predicted_s,
               "pipeline/bubble": plan.breakdown["bubble"]}
    sampled = self.balancer is not None and self.balancer.due(step)
    if self.run.run_ahead and self.emulated is None and not sampled:
      if self._one_behind and self._previous is not None:
        jax.block_until_ready(self._previous)
      self._previous = m
      return executor_lib.StepResult(m, None, scalars)
    m = {k: float(v) for k, v in jax.device_get(m).items()}      # waits for the step
    if self.emulated is not None:
      emulated = self._emulated_at(step)
      emulation.Emulator.sleep(emulated["step_s"])
      scalars["pipeline/emulated_s"] = emulated["step_s"]
    notes = ()
    if self.balancer is not None:
      self.state, note = self.balancer.after_step(step, self.state)
      if note is not None:
        self.layout, self.counts = self.balancer.layout, self.balancer.microbatches
        self.pplan = self.engine.plan(self.layout, self.counts)
        notes = (note,)
    return executor_lib.StepResult(m, time.perf_counter() - t0, scalars, notes=notes)

  def _emulated_at(self, step: int) -> dict:
    """The emulated time of 0-based `step`: at its speeds (`hetero.rotate_every`) and in the
    current layout; the plan's fixed one where neither changes."""
    if self.balancer is None and not self.run.pipeline.rotate_every:
      return self.emulated
    devices = self.setup.emulator.devices
    emulator = self.setup.emulator.with_speeds(
        devices.speeds_at(step, self.run.pipeline.rotate_every))
    return emulator.layout_step(self.layout, self.counts)

  def evaluate(self) -> dict:
    """The evaluation batches' metrics, in the plan's microbatches per pipeline."""
    split = self.setup.plan.microbatches
    pplan = self.pplan if self.counts == split else self.engine.plan(self.layout, split)
    return steps_lib.evaluate(self.engine, self.state.params, self.eval_batches, pplan)

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> None:
    """Checkpoints the state through the sharded logical form (donated, then back), with the
    layout and plan in the meta."""
    engine, layout = self.engine, self.layout
    meta = dict(meta, layout=layout.to_json(), microbatches=list(self.counts),
                **setup_lib.checkpoint_meta(self.setup.plan))
    logical = engine.to_logical(self.state, layout, donate=True)
    ckpt.save(step, logical, meta)
    self.state = engine.to_padded(logical, layout, donate=True)

  def summary(self, base: dict) -> executor_lib.Finish:
    plan, mean_dt = self.setup.plan, base["mean_step_time_s"]
    error = (f", {100 * (mean_dt / plan.predicted_s - 1):+.1f}% against the predicted "
             f"{plan.predicted_s:.3f} s" if self.emulated is not None else "")
    keys = {"plan": plan.to_dict(), "predicted_s": plan.predicted_s,
            "bubble": plan.breakdown["bubble"],
            "emulated_s": None if self.emulated is None else self.emulated["step_s"]}
    replans = ""
    if self.balancer is not None:
      keys.update(self.balancer.summary())
      replans = f", {keys['replans']} re-plans ({keys['replan_compiles']} compiles)"
    return executor_lib.Finish(keys, before_val=f", mean step {mean_dt:.3f} s{error}{replans}")


class FixedPlan:
  """A pipelined run's plan as the `executor.Placement` of `replicas.Replicas` (ssaw, async and
  local_sgd with data-parallel pipelines): the layout never changes, and each pipeline's
  emulated seconds for its share of a batch are its pipeline time
  (`pipeline_setup.emulated_step`) plus the gradient all-reduces after it (`delay_s`, [R]; the
  data all-reduce is the round's).

  Args:
    setup: the run's plan, engine, layout and emulation (`pipeline_setup.build`).
  """

  def __init__(self, setup: setup_lib.Setup):
    self.setup, self.layout, self.emulator = setup, setup.layout, setup.emulator
    self.pplan = setup.engine.plan(setup.layout, setup.plan.microbatches)
    self.emulated = setup_lib.emulated_step(setup) if setup.emulator is not None else None
    self.delay_s = (1.0 if self.emulated is None else
                    np.asarray(self.emulated["pipeline_s"]) + self.emulated["allreduce_s"])
    self.compiles_at_warmup = 0

  def warm_up(self, state, batch, eval_batch, step: int):
    """Compiles the engine's train step (a round that is a synchronous step runs it) and eval
    program."""
    del step
    self.setup.engine.compile(state, batch, self.pplan, eval_batch)
    return state

  def before_step(self, step: int, state):
    del step
    return state, self.pplan

  def after_step(self, step: int, seconds: float) -> dict:
    del step, seconds
    return {}

  def state_dict(self) -> dict:
    return {}

  def summary(self, total_s: float) -> dict:
    del total_s
    return {"policy": "plan", "pipeline_s": None if self.emulated is None
            else self.emulated["pipeline_s"]}
