"""The plan of a pipelined or planned run (`config.mesh.pipe` > 1 or `config.plan`), and the
engine, layout and emulation it builds.

A run's plan (`semijax.planner.Plan`) says everything the pipelined engine (`core.pipeline`)
needs: the mesh (data x pipe x tensor) and the device at each position, the layers per stage,
the units per tensor position, the microbatches per data-parallel pipeline and their size, the
schedule. It comes from the planner (`config.plan = "auto"`), from a plan file
(`experiments/plan.py --out`), or from the config itself (`mesh`, `pipeline.*`, `layout.*`,
devices in id order). Each stage's tensor layout compiles exactly the unit counts it uses as
its widths, so every device executes its own share and no more.

With `hetero.device_speeds` or `hetero.links`, the devices and links are emulated
(`core.emulation.PipelineEmulator`): after every step the host sleeps for the time the plan's
devices and links would take for what the step executed (`emulated_step`).
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np

from semijax import models
from semijax.balance import buckets as buckets_lib
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline
from semijax.errors import ConfigError
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import plan as planner_plan
from semijax.planner import predict as predict_lib
from semijax.planner import search
from semijax.train import config as config_lib
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib

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
    for kind, total in spec.num_units().items():     # heads: KV groups with grouped queries
      counts = p.mlp if kind == "mlp" else p.heads
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
  if set(spec.num_units()) != {"mlp", "heads"}:
    raise ConfigError(f"config.model: the pipeline knows kinds mlp and heads, got "
                      f"{sorted(spec.num_units())}")
  cap = layer_capacity or max(plan.stage_layers)
  if cap < max(plan.stage_layers):
    raise ConfigError(f"config.pipeline.layer_capacity: {cap} slots, but a stage holds "
                      f"{max(plan.stage_layers)} layers")
  return pipeline.PipeLayout.build(spec.num_layers, plan.stage_layers, units, capacity=cap)


def replanning_layout(layout: pipeline.PipeLayout, factor: float, num_widths: int,
                      layer_capacity: int = 0) -> pipeline.PipeLayout:
  """`layout` (same owners) in the compiled shapes a re-planning run (`semi`) moves within: per
  kind the units' big bucket (`factor` x the even share, `num_widths` widths,
  `balance.buckets.bucket_layout`; the widest any stage needs), the same in every stage, and
  `layer_capacity` slots per stage (0: `factor` x the even share of layers, at most what leaves
  every other stage one)."""
  stages, num_layers = layout.stages, layout.layers.num_units
  big = [buckets_lib.bucket_layout(u, factor, num_widths).kinds() for u in layout.units]
  widest = layout_lib.Layout(**{k: max((b[k] for b in big), key=lambda u: u.capacity)
                                for k in big[0]})
  units = [buckets_lib.bucket_like(u, widest) for u in layout.units]
  cap = layer_capacity or min(num_layers - stages + 1, math.ceil(factor * num_layers / stages))
  cap = max(cap, max(layout.stage_layers))
  return pipeline.PipeLayout.build(num_layers, layout.stage_layers, units, capacity=cap)


def microbatch_slots(run: config_lib.RunConfig, plan: planner_plan.Plan) -> int:
  """Microbatches compiled per pipeline (the length of the step's tick table, whose idle ticks
  skip their compute): `pipeline.microbatch_capacity`, else the most a pipeline of the plan runs;
  a re-planning (`semi`) run of several pipelines gets room to re-split the batch between them:
  `balance.capacity_factor` x the largest share, at most the total less one for each other
  pipeline.

  Raises:
    ConfigError: `pipeline.microbatch_capacity` below what a pipeline of the plan runs, or set
      in a replica sync mode (each pipeline runs its equal share as compiled).
  """
  most, cap = max(plan.microbatches), run.pipeline.microbatch_capacity
  if cap and run.sync.mode != "sync":
    raise ConfigError(f"config.pipeline.microbatch_capacity: sync mode {run.sync.mode!r} runs "
                      f"each pipeline's equal share of the batch as compiled; leave it 0")
  if cap and cap < most:
    raise ConfigError(f"config.pipeline.microbatch_capacity: {cap}, but a pipeline of the plan "
                      f"runs {most} microbatches ({list(plan.microbatches)})")
  if cap:
    return cap
  if run.balance.policy == "semi" and len(plan.microbatches) > 1:
    total, others = sum(plan.microbatches), len(plan.microbatches) - 1
    return max(most, min(total - others, math.ceil(run.balance.capacity_factor * most)))
  return most


# --- the engine and its emulation --------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Setup:
  """What a pipelined run runs: the plan, the engine, its layout, the emulation (or None), and
  the time model a re-planning run prices layouts with: the emulation, or without one the
  plan's devices at speed 1 over free links (`semi` scales it by the measured speeds)."""

  plan: planner_plan.Plan
  engine: pipeline.PipelineEngine
  layout: pipeline.PipeLayout
  emulator: emulation.PipelineEmulator | None
  time_model: emulation.PipelineEmulator


def build(run: config_lib.RunConfig, plan: planner_plan.Plan) -> Setup:
  """The engine on the plan's mesh (devices placed as it says), its layout and emulation."""
  devices = jax.devices()
  mesh = mesh_lib.make_pipeline_mesh(plan.data, plan.pipe, plan.tensor,
                                     [devices[i] for i in plan.device_order])
  model_fn, loss_terms = models.build(run.model)
  engine = pipeline.PipelineEngine(model_fn, loss_terms, mesh,
                                   optimizer_lib.make(run.optimizer, run.steps),
                                   schedule=plan.schedule, microbatches=microbatch_slots(run, plan),
                                   kernel=run.kernel)
  layout = pipe_layout(plan, run.model, run.pipeline.layer_capacity)
  if run.balance.policy == "semi":
    layout = replanning_layout(layout, run.balance.capacity_factor,
                               run.balance.num_widths or run.pipeline.num_widths,
                               run.pipeline.layer_capacity)
  n = plan.num_devices
  emulated = run.pipeline.devices
  tokens = plan.microbatch_size * run.model.seq_len
  stack_bytes, shared_bytes = engine.local_bytes(layout)
  costs = model_costs(run)
  model = emulation.PipelineEmulator(
      emulated if emulated is not None else emulation.Devices(
          np.ones(n), np.zeros((n, n)), np.full((n, n), np.inf)),
      plan.grid(), costs.unit_ms(tokens), costs.activation_bytes(tokens), stack_bytes,
      shared_bytes, plan.schedule, tuple(1e3 * costs.edge_s(tokens, plan.pipe)))
  return Setup(plan, engine, layout, model if emulated is not None else None, model)


def emulated_step(setup: Setup) -> dict:
  """The emulated time of one step of `setup` (`PipelineEmulator.step` on what it executes)."""
  return setup.emulator.layout_step(setup.layout, setup.plan.microbatches)


def checkpoint_meta(plan: planner_plan.Plan) -> dict:
  """What a pipelined checkpoint's metadata says of its plan (`pipelined.Pipelined.restore`
  reads it back)."""
  return {"pipe": plan.pipe, "plan": plan.to_dict()}
