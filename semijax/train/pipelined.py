"""Pipelined and planned runs (`config.mesh.pipe` > 1 or `config.plan`): the plan, the engine
and the loop.

A run's plan (`semijax.planner.Plan`) says everything the pipelined engine (`core.pipeline`)
needs: the mesh (data x pipe x tensor) and the device at each position, the layers per stage,
the units per tensor position, the microbatches per data-parallel pipeline and their size, the
schedule. It comes from the planner (`config.plan = "auto"`), from a plan file
(`experiments/plan.py --out`), or from the config itself (`mesh`, `pipeline.*`, `layout.*`,
devices in id order). Each stage's tensor layout compiles exactly the unit counts it uses as
its widths, so every device executes its own share and no more.

With `hetero.device_speeds` or `hetero.links`, the devices and links are emulated
(`core.emulation.PipelineEmulator`): after every step the host sleeps for the time the plan's
devices and links would take for what the step executed. The step's measured time is that
plus the real compute; the plan's prediction (`planner.predict`) is checked against it.

With a replica sync mode (the plan's `sync`: ssaw, async or local_sgd; `for_plan`), the
pipelines are the replicas of `replica_loop`, with `FixedPlan` in the balancer's place: every
pipeline gets its own gradient (`PipelineEngine.replica_grads_and_terms`) and `semijax.sync`
combines them.

Order of work as in `trainer.Trainer`: the plan and every check before compiling; the
latest checkpoint of workdir resumes the run (only onto the same number of stages: the
logical form stacks layers per stage); warm-up compiles the train and eval programs; then the
steps.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Callable

import jax
import numpy as np

from semijax import models
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline
from semijax.core import plan as plan_lib
from semijax.errors import ConfigError
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import plan as planner_plan
from semijax.planner import predict as predict_lib
from semijax.planner import search
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib
from semijax.train import replica_loop
from semijax.train import steps as steps_lib

say = metrics_lib.say


# --- the plan ---------------------------------------------------------------------------------


def model_costs(run: config_lib.RunConfig) -> costs_lib.ModelCosts:
  """The planner's view of the run's model at the emulated device rate, in its precision and
  with its optimizer's first-moment dtype."""
  return costs_lib.ModelCosts.from_spec(run.model, run.hetero.device_gflops,
                                        run.optimizer.mu_dtype)


def cluster(run: config_lib.RunConfig, num_devices: int) -> cluster_lib.Cluster:
  """The planner's view of the run's devices: the emulated speeds and links, or `num_devices`
  equal devices with free links."""
  memory = run.pipeline.memory_gb * 1e9 or np.inf
  d = run.pipeline.devices
  if d is None:
    return cluster_lib.Cluster(np.ones(num_devices), memory, np.zeros((num_devices,) * 2),
                               np.full((num_devices,) * 2, np.inf))
  return cluster_lib.Cluster(d.speeds, memory, d.latency_s, d.bandwidth, d.regions)


def _configured(run: config_lib.RunConfig) -> planner_plan.Plan:
  """The plan a config spells out (`mesh`, `pipeline.*`, `layout.*`; devices in id order)."""
  p, m, spec = run.pipeline, run.mesh, run.model
  layers = (layout_lib.even_counts(spec.num_layers, m.pipe) if p.layers == "even"
            else p.layers)
  units = []
  for s in range(m.pipe):
    stage = {}
    for kind, total, counts in (("mlp", spec.d_ff, p.mlp), ("heads", spec.num_heads, p.heads)):
      stage[kind] = layout_lib.even_counts(total, m.tensor) if counts == "even" else counts[s]
    units.append(stage)
  return planner_plan.Plan(data=m.data, pipe=m.pipe, tensor=m.tensor,
                           device_order=tuple(range(m.size)), stage_layers=tuple(layers),
                           stage_units=tuple(units), microbatches=p.microbatches,
                           microbatch_size=run.batch_size // sum(p.microbatches),
                           schedule=p.schedule, sync=run.sync.mode)


def load_plan(path: str) -> planner_plan.Plan:
  """A plan saved by `experiments/plan.py --out` (bad fields raise ConfigError naming them)."""
  try:
    with open(path) as f:
      d = json.load(f)
  except (OSError, json.JSONDecodeError) as e:
    raise ConfigError(f"config.plan: cannot read a plan from {path!r}: {e}") from None
  fields = {f.name for f in dataclasses.fields(planner_plan.Plan)}
  if not isinstance(d, dict) or not {"data", "pipe", "tensor"} <= set(d):
    raise ConfigError(f"config.plan: {path!r} holds no plan (experiments/plan.py --out writes one)")
  d = {k: v for k, v in d.items() if k in fields and k not in ("predicted_s", "breakdown")}
  return planner_plan.Plan(**d)


def resolve_plan(run: config_lib.RunConfig, num_devices: int) -> planner_plan.Plan:
  """The run's plan with its predicted step time (see module doc).

  Raises:
    ConfigError: the plan does not fit the devices, model or batch (named).
  """
  p = run.pipeline
  costs = model_costs(run)
  if p.plan == "auto":
    n = len(p.devices.speeds) if p.devices is not None else num_devices
    if n > num_devices:
      raise ConfigError(f"config.hetero.device_speeds: {n} devices, only {num_devices} exist")
    sizes = p.microbatch_sizes or tuple(m for m in range(1, run.batch_size + 1)
                                        if run.batch_size % m == 0)
    plan = search.plan(costs, cluster(run, n), run.batch_size, sizes, p.schedules, p.syncs)
  else:
    plan = load_plan(p.plan) if p.plan else _configured(run)
    if run.sync.mode not in ("sync", plan.sync):
      raise ConfigError(f"config.sync.mode: {run.sync.mode!r}, but the plan {p.plan!r} combines "
                        f"its pipelines with {plan.sync!r}; leave sync.mode 'sync' to follow the "
                        "plan, or plan again")
  if plan.num_devices > num_devices:
    raise ConfigError(f"config.plan: the plan places {plan.num_devices} devices, only "
                      f"{num_devices} exist")
  if p.devices is not None and len(p.devices.speeds) != plan.num_devices:
    raise ConfigError(f"config.hetero.device_speeds: {len(p.devices.speeds)} devices, the plan "
                      f"places {plan.num_devices}")
  if plan.global_batch != run.batch_size:
    raise ConfigError(f"config.batch_size: {run.batch_size}, but the plan's microbatches "
                      f"{plan.microbatches} x {plan.microbatch_size} examples make "
                      f"{plan.global_batch}")
  try:
    return predict_lib.with_prediction(plan, costs, cluster(run, plan.num_devices))
  except ValueError as e:
    raise ConfigError(f"config.plan: {e}") from None


def for_plan(run: config_lib.RunConfig, plan: planner_plan.Plan) -> config_lib.RunConfig:
  """The run as `plan` shapes it: its mesh and its sync mode (with config.sync's settings).

  Raises:
    ConfigError: a replica mode (ssaw, async, local_sgd) with unequal microbatches per pipeline
      (each pipeline's share of the stream is batch_size / data examples).
  """
  mode = plan.sync
  if plan.data == 1 and mode != "sync":
    say(f"sync mode {mode!r}: the plan has one pipeline, which waits for no one; training 'sync'")
    mode = "sync"
  sync = dataclasses.replace(run.sync, mode=mode).validate(plan.data)
  if sync.mode != "sync" and len(set(plan.microbatches)) > 1:
    raise ConfigError(f"config.pipeline.microbatches: sync mode {sync.mode!r} gives every "
                      f"pipeline the same share of each batch; got {plan.microbatches} (the "
                      "replica modes let fast pipelines run ahead instead)")
  return dataclasses.replace(run, sync=sync,
                             mesh=mesh_lib.MeshSpec(plan.data, plan.tensor, plan.pipe))


def pipe_layout(plan: planner_plan.Plan, spec, layer_capacity: int = 0) -> pipeline.PipeLayout:
  """The engine's layout of `plan`: each kind's capacity the most units any device holds, its
  compiled widths exactly the counts the stages use."""
  stages = []
  for kind in ("mlp", "heads"):
    counts = [u[kind] for u in plan.stage_units]
    widths = tuple(sorted({c for stage in counts for c in stage}))
    stages.append([layout_lib.UnitLayout.from_counts(kind, c, capacity=widths[-1], widths=widths)
                   for c in counts])
  units = [layout_lib.Layout(mlp=m, heads=h) for m, h in zip(*stages)]
  if spec.num_units() != {"mlp": spec.d_ff, "heads": spec.num_heads}:
    raise ConfigError(f"config.model: the pipeline knows kinds mlp and heads, got "
                      f"{sorted(spec.num_units())}")
  cap = layer_capacity or max(plan.stage_layers)
  if cap < max(plan.stage_layers):
    raise ConfigError(f"config.pipeline.layer_capacity: {cap} slots, but a stage holds "
                      f"{max(plan.stage_layers)} layers")
  return pipeline.PipeLayout.build(spec.num_layers, plan.stage_layers, units, capacity=cap)


# --- the engine and its emulation --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a pipelined run runs: the plan, the engine, its layout and the emulation (or None)."""

  plan: planner_plan.Plan
  engine: pipeline.PipelineEngine
  layout: pipeline.PipeLayout
  emulator: emulation.PipelineEmulator | None


def build(run: config_lib.RunConfig, plan: planner_plan.Plan) -> Setup:
  """The engine on the plan's mesh (devices placed as it says), its layout and emulation."""
  devices = jax.devices()
  mesh = mesh_lib.make_pipeline_mesh(plan.data, plan.pipe, plan.tensor,
                                     [devices[i] for i in plan.device_order])
  model_fn, loss_terms = models.build(run.model)
  engine = pipeline.PipelineEngine(model_fn, loss_terms, mesh,
                                   optimizer_lib.make(run.optimizer, run.steps),
                                   schedule=plan.schedule, microbatches=max(plan.microbatches))
  layout = pipe_layout(plan, run.model, run.pipeline.layer_capacity)
  emulator = None
  if run.pipeline.devices is not None:
    tokens = plan.microbatch_size * run.model.seq_len
    stack_bytes, shared_bytes = engine.local_bytes(layout)
    costs = model_costs(run)
    emulator = emulation.PipelineEmulator(
        run.pipeline.devices, plan.grid(), costs.unit_ms(tokens),
        costs.activation_bytes(tokens), stack_bytes, shared_bytes, plan.schedule,
        tuple(1e3 * costs.edge_s(tokens, plan.pipe)))
  return Setup(plan, engine, layout, emulator)


def emulated_step(setup: Setup) -> dict:
  """The emulated time of one step of `setup` (`PipelineEmulator.step` on what it executes)."""
  executed = [{k: w[:, 0] for k, w in plan_lib.executed_widths(u, 1).items()}
              for u in setup.layout.units]
  return setup.emulator.step(setup.layout.stage_layers, executed, setup.plan.microbatches)


# --- the loop ----------------------------------------------------------------------------------


def _restore_or_init(setup: Setup, ckpt, run: config_lib.RunConfig):
  """(padded state, start step) from the latest checkpoint in workdir, or from the seed."""
  engine, layout = setup.engine, setup.layout
  step = ckpt.latest_step()
  if step is None:
    return engine.init(run.seed, layout), 0
  meta = ckpt.read_meta(step)
  if meta.get("model") != run.model.to_dict():
    raise ConfigError(
        f"config.model: the checkpoint at step {step} in {ckpt.directory} was trained with model "
        f"{meta.get('model')}, not {run.model.to_dict()}; use another --workdir")
  saved = meta.get("pipe")
  if saved != setup.plan.pipe:
    where = "unpipelined" if saved is None else f"on {saved} stages"
    raise ConfigError(
        f"config.mesh.pipe: the checkpoint at step {step} in {ckpt.directory} was saved {where}, "
        f"this run has {setup.plan.pipe} stages; pipelined checkpoints restore onto the same "
        "number of stages (use another --workdir)")
  saved_sync = meta.get("sync_mode", "sync")
  if saved_sync != run.sync.mode:
    raise ConfigError(
        f"config.sync.mode: the checkpoint at step {step} in {ckpt.directory} was saved by a "
        f"{saved_sync!r} run, this one is {run.sync.mode!r} (its in-flight state would be lost); "
        "use another --workdir")
  abstract = engine.abstract_logical()
  logical, meta = ckpt.restore(abstract, step)
  say(f"resumed from step {step} ({ckpt.directory}/{step}, saved with layers per stage "
      f"{meta['plan']['stage_layers']}{checkpoint_lib.dtype_change(meta, abstract)}), "
      f"continuing to step {run.steps}")
  return engine.to_padded(logical, layout, donate=True), int(meta["data_position"])


def checkpoint_meta(plan: planner_plan.Plan) -> dict:
  """What a pipelined checkpoint's metadata says of its plan (`_restore_or_init` reads it)."""
  return {"pipe": plan.pipe, "plan": plan.to_dict()}


class FixedPlan:
  """A pipelined run's plan in the balancer's place for `replica_loop` (ssaw, async and
  local_sgd with data-parallel pipelines): the layout never changes, and each pipeline's
  emulated seconds for its share of a batch are its pipeline time (`emulated_step`) plus the
  gradient all-reduces after it (`delay_s`, [R]; the data all-reduce is the round's).

  Args:
    setup: the run's plan, engine, layout and emulation (`build`).
  """

  def __init__(self, setup: Setup):
    self.setup, self.layout, self.emulator = setup, setup.layout, setup.emulator
    self.pplan = setup.engine.plan(setup.layout, setup.plan.microbatches)
    self.emulated = emulated_step(setup) if setup.emulator is not None else None
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

  def after_step(self, step: int, seconds: float) -> None:
    del step, seconds

  def state_dict(self) -> dict:
    return {}

  def summary(self, total_s: float) -> dict:
    del total_s
    return {"policy": "plan", "pipeline_s": None if self.emulated is None
            else self.emulated["pipeline_s"]}


class Trainer:
  """The steps of one pipelined run, one at a time (the loop below; benchmarks interleave
  several).

  Args:
    run: the validated run; setup: its plan, engine, layout and emulation (`build`);
    dataset: its data (every process arranges the whole global batch); state: the padded
    train state (donated to the steps).
  """

  def __init__(self, run: config_lib.RunConfig, setup: Setup, dataset, state):
    self.run, self.setup, self.dataset, self.state = run, setup, dataset, state
    self.counts = setup.plan.microbatches
    self.pplan = setup.engine.plan(setup.layout, self.counts)
    self.eval_batches = [setup.engine.arrange_batch(b, self.counts)
                         for b in dataset.eval_batches()]
    self.emulated = emulated_step(setup) if setup.emulator is not None else None

  def warm_up(self, step: int) -> float:
    """Compiles the train and eval programs; returns the seconds it took."""
    t0 = time.perf_counter()
    batch = self.setup.engine.arrange_batch(self.dataset.train_batch(step), self.counts)
    self.setup.engine.compile(self.state, batch, self.pplan, self.eval_batches[0])
    steps_lib.start_together("semijax pipelined warm-up")
    return time.perf_counter() - t0

  def step(self, step: int) -> tuple[dict, float]:
    """Runs 0-based `step` (and the emulated devices' time); returns (metrics as floats, its
    seconds)."""
    batch = self.setup.engine.arrange_batch(self.dataset.train_batch(step), self.counts)
    t0 = time.perf_counter()
    self.state, m = self.setup.engine.train_step(self.state, batch, self.pplan)
    m = {k: float(v) for k, v in jax.device_get(m).items()}      # waits for the step
    if self.emulated is not None:
      emulation.Emulator.sleep(self.emulated["step_s"])
    return m, time.perf_counter() - t0

  def evaluate(self) -> dict:
    """Validation loss and accuracy over every evaluation batch."""
    return steps_lib.evaluate(self.setup.engine, self.state.params, self.eval_batches,
                              self.pplan)

  def save(self, ckpt, step: int) -> None:
    """Checkpoints the state through the sharded logical form (donated, then back)."""
    engine, layout, plan = self.setup.engine, self.setup.layout, self.setup.plan
    meta = {"data_position": step, "model": self.run.model.to_dict(), "layout": layout.to_json(),
            **checkpoint_meta(plan)}
    logical = engine.to_logical(self.state, layout, donate=True)
    ckpt.save(step, logical, meta)
    self.state = engine.to_padded(logical, layout, donate=True)


def train(run: config_lib.RunConfig, workdir: str, *,
          after_warmup: Callable[[], None] | None = None) -> dict:
  """Trains a pipelined or planned run in `workdir` (auto-resuming); returns its summary (the
  keys of `loop.train_and_evaluate`'s, plus "plan", "predicted_s", "emulated_s", "bubble")."""
  plan = resolve_plan(run, jax.device_count())
  source = {"auto": "the planner", "": "config"}.get(run.pipeline.plan, run.pipeline.plan)
  say(f"plan ({source}):\n{planner_plan.describe(plan)}")
  run = for_plan(run, plan)
  dataset = data_lib.build(run.data, 0, 1)
  setup = build(run, plan)
  with contextlib.ExitStack() as stack:
    ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       keep=run.keep_checkpoints)
    stack.callback(ckpt.close)
    state, start = _restore_or_init(setup, ckpt, run)
    writer = stack.enter_context(metrics_lib.MetricWriter(workdir, resume_step=start))
    writer.write_config(run.source)
    if jax.process_index() == 0:
      with open(os.path.join(workdir, "plan.json"), "w") as f:
        json.dump(plan.to_dict(), f, indent=1)
    if run.sync.mode != "sync":
      extra = ckpt.restore_extra(start) if start else None
      return replica_loop.train(run, setup.engine, FixedPlan(setup), ckpt, writer, dataset,
                                state, start, extra, after_warmup=after_warmup,
                                evaluate=steps_lib.evaluate, meta=checkpoint_meta(plan))
    trainer = Trainer(run, setup, dataset, state)
    seconds = trainer.warm_up(start)
    say(f"warm-up: {setup.engine.compile_count} step programs compiled, {seconds:.1f} s")
    if after_warmup is not None:
      after_warmup()
    return _steps(run, trainer, ckpt, writer, start)


def _steps(run, trainer: Trainer, ckpt, writer, start: int) -> dict:
  plan = trainer.setup.plan
  learning_rates = steps_lib.learning_rates(run)
  unit = run.model.unit
  items_per_step = run.batch_size * run.model.items_per_example
  progress = metrics_lib.Progress(run.steps, unit=unit, start_step=start)
  step_times, losses, val = [], [], {}
  last_saved = start if start else None
  for step in range(start + 1, run.steps + 1):
    m, dt = trainer.step(step - 1)
    loss = m["loss"]
    steps_lib.stop_if_not_finite(loss, step, writer, ckpt.directory, last_saved)
    step_times.append(dt)
    losses.append(loss)
    scalars = dict(steps_lib.scalars(m, learning_rates[step - 1], dt, unit, items_per_step),
                   **{"pipeline/predicted_s": plan.predicted_s,
                      "pipeline/bubble": plan.breakdown["bubble"]})
    if trainer.emulated is not None:
      scalars["pipeline/emulated_s"] = trainer.emulated["step_s"]
    if step % run.eval_every == 0 or step == run.steps:
      val = trainer.evaluate()
      scalars.update(val)
    if step % run.log_every == 0 or step == run.steps or "val/loss" in scalars:
      steps_lib.record(writer, progress, step, dt, items_per_step, scalars)
    if (run.checkpoint_every and step % run.checkpoint_every == 0) or step == run.steps:
      trainer.save(ckpt, step)
      last_saved = step
  summary = dict(steps_lib.summary(run, start, step_times, losses, val), plan=plan.to_dict(),
                 predicted_s=plan.predicted_s, bubble=plan.breakdown["bubble"],
                 emulated_s=None if trainer.emulated is None else trainer.emulated["step_s"])
  mean_dt = summary["mean_step_time_s"]
  error = (f", {100 * (mean_dt / plan.predicted_s - 1):+.1f}% against the predicted "
           f"{plan.predicted_s:.3f} s" if trainer.emulated is not None else "")
  say(f"done: {len(step_times)} steps, {summary[f'{unit}_per_s']:,.0f} {unit}/s, "
      f"mean step {mean_dt:.3f} s{error}, val_loss {val.get('val/loss', float('nan')):.4f}")
  return summary
