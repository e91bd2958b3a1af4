"""The discrete-event simulation of a training run: `simulate(run, trace)`.

Events are steps on a simulated clock. Before each step the trace says every device's speed and
every region link's bandwidth factor (`traces.Trace.at`); every pipeline stage's balancer
(`stage.StageBalancer`: the library's policy, controller, cost model and speed tracker) decides,
migrates if it chose to, and says what every device executes; the step model
(`stepcost.StepModel`) turns widths and speeds into the step's seconds; in an emulated replay
the library's own `core.emulation.Emulator` adds the host sleep of the emulated slowdown. The
clock advances by the step, any migration before it and the speed sample after it (every
`balance.probe_every` steps, `Hardware.sample_s`), exactly what the training loop's step time
holds. The stages' samplers get the step's seconds without migration and sampling, and the
relative time of each tensor position (the slowest replica's, with `Hardware.sample_noise`).
A step's seconds carry `Hardware.step_noise` (seeded), so that the cost model's online fit sees
what it sees on a shared host.

`Run` is one simulated run: workload, cluster, hardware, policy and balance settings. `Result`
holds per-step seconds, throughput, the decisions taken, and the ideal throughput of the same
clock (each step's work at the cluster's mean speed: total work over total speed).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from semijax.balance import resize as resize_spec_lib
from semijax.balance import settings as settings_lib
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import migrate as migrate_lib
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import stage as stage_lib
from semijax.sim import stepcost
from semijax.sim import strategies
from semijax.sim import traces as traces_lib
from semijax.sim import workload as workload_lib

@dataclasses.dataclass(frozen=True)
class Run:
  """One simulated run.

  Attributes:
    workload, cluster, hardware: what is trained, on what.
    settings: `BalanceSettings`; `settings.policy` is the policy.
    steps: steps to simulate.
    resize: `ResizeSpec` (how resizing selects; a `static` schedule).
    layout_widths: `layout.num_widths` of the configured layout.
    static_counts: per stage {kind: counts} of the configured split (the static oracle), or
      None for the even split.
    hetero: an emulated slowdown (`core.emulation.Hetero`) for replays of emulated runs.
    strategy: the data-parallel strategy (`strategies.REGISTRY`).
    layers: layers per pipeline stage (default as even as possible).
    seed: sample noise and priorities.
    epoch_steps: steps per epoch (a static resize schedule's period).
    script: per stage, {0-based step: `cost.Setup`} recorded decisions to replay instead of
      deciding (`stage.StageBalancer`), or None.
    idle_feature: compute the step features' column of `Hardware.idle_speedup` also where it
      is 1 (`stepcost.StepModel`; the calibration's replays, which fit it).
  """

  workload: workload_lib.Workload
  cluster: cluster_lib.Cluster
  hardware: hardware_lib.Hardware
  settings: settings_lib.BalanceSettings
  steps: int
  resize: resize_spec_lib.ResizeSpec = resize_spec_lib.ResizeSpec()
  layout_widths: int = layout_lib.DEFAULT_NUM_WIDTHS
  static_counts: tuple | None = None
  hetero: emulation.Hetero | None = None
  strategy: str = "sync"
  layers: tuple | None = None
  seed: int = 0
  epoch_steps: int = 1
  script: tuple | None = None
  idle_feature: bool = False

  @property
  def policy(self) -> str:
    return self.settings.policy

  def with_policy(self, policy: str, static_counts=None) -> "Run":
    return dataclasses.replace(self, settings=dataclasses.replace(self.settings, policy=policy),
                               static_counts=static_counts)


@dataclasses.dataclass
class Result:
  """A simulated run (see module doc); `to_json` keeps what a report needs."""

  policy: str
  step_s: np.ndarray               # float [steps]: each step as the loop records it
  tokens_per_step: float
  ideal_s: float                   # total seconds of the same steps at the cluster's mean speed
  position_speeds: np.ndarray      # float [S, T]: mean slowest-replica speed of each position
  stages: list                     # per stage: {"stats", "counts", "changes"}
  features: np.ndarray             # float [steps, 7]: `StepTime.features`
  fixed_s: np.ndarray              # float [steps]: the part of each step outside the fit
  wall_s: float = 0.0              # host seconds the simulation took
  staleness: float = 0.0           # mean predicted staleness (`semijax.sync` strategies)

  @property
  def seconds(self) -> float:
    return float(self.step_s.sum())

  @property
  def tokens_per_s(self) -> float:
    return self.tokens_per_step * len(self.step_s) / self.seconds

  @property
  def ideal_tokens_per_s(self) -> float:
    return self.tokens_per_step * len(self.step_s) / self.ideal_s

  def stat(self, name: str) -> float:
    return float(sum(s["stats"][name] for s in self.stages))

  def to_json(self, steps: bool = False) -> dict:
    out = {"policy": self.policy, "tokens_per_s": self.tokens_per_s,
           "mean_staleness": self.staleness,
           "mean_step_s": float(self.step_s.mean()), "steps": len(self.step_s),
           "ideal_tokens_per_s": self.ideal_tokens_per_s,
           "migrations": int(self.stat("migrations")), "decisions": int(self.stat("decisions")),
           "changes": int(self.stat("changes")), "move_s": self.stat("move_s"),
           "decide_s": self.stat("decide_s"), "resized_steps": int(self.stat("resized_steps")),
           "final_counts": [s["counts"] for s in self.stages], "wall_s": self.wall_s}
    if steps:
      out["step_s"] = [round(float(x), 6) for x in self.step_s]
    return out


def _move_seconds(hw: hardware_lib.Hardware, workload: workload_lib.Workload, layers: int,
                  num_devices: int):
  """A stage's migration cost: `move_fixed_s` + the local gathers over the device's unit state
  (`move_local_bytes_per_s`) + the all_to_all's bytes (`core.migrate`'s wire slots x a unit's
  weights and moments in the stage, at their stored dtypes: `Workload.unit_state_bytes`) at
  `move_bytes_per_s`."""
  per_unit = {k: b * layers / workload.spec.num_layers
              for k, b in workload.unit_state_bytes().items()}
  units = workload.spec.num_units()
  local = sum(per_unit[k] * u for k, u in units.items()) / num_devices

  def seconds(moves: migrate_lib.Moves) -> float:
    wire = sum(per_unit[k] * m.wire_slots for k, m in moves.kinds.items()) / num_devices
    return hw.move_fixed_s + local / hw.move_local_bytes_per_s + wire / hw.move_bytes_per_s
  return seconds


def _layout(spec, n: int, counts: dict | None, num_widths: int) -> layout_lib.Layout:
  counts = counts or {}
  return layout_lib.Layout.for_model(d_model=spec.d_model, num_heads=spec.num_units()["heads"],
                                     d_ff=spec.d_ff, num_devices=n,
                                     mlp=counts.get("mlp", "even"),
                                     heads=counts.get("heads", "even"), num_widths=num_widths)


def stages_of(run: Run, model: stepcost.StepModel) -> list[stage_lib.StageBalancer]:
  """One `StageBalancer` per pipeline stage of `run`."""
  out = []
  w = run.workload
  for s, layers in enumerate(model.layers):
    spec = stage_lib.stage_spec(w.spec, layers)
    counts = None if run.static_counts is None else run.static_counts[s]
    layout = _layout(spec, run.cluster.tensor, counts, run.layout_widths)
    unit_bytes = {k: b * layers / w.spec.num_layers for k, b in w.unit_bytes().items()}
    out.append(stage_lib.StageBalancer(
        run.settings, run.resize, spec, layout, unit_bytes,
        _move_seconds(run.hardware, w, layers, run.cluster.tensor), epoch_steps=run.epoch_steps,
        hetero=run.hetero if run.hardware.emulated else None, seed=run.seed + s,
        script=None if run.script is None else run.script[s]))
  return out


def simulate(run: Run, trace: traces_lib.Trace) -> Result:
  """Simulates `run` under `trace` (see module doc)."""
  t_start = time.perf_counter()
  c, hw, w = run.cluster, run.hardware, run.workload
  if trace.num_devices != c.devices:
    raise ValueError(f"sim.trace: {trace.num_devices} devices for a cluster of {c.devices}")
  strategy = strategies.make(run.strategy)
  model = stepcost.StepModel(w, c, hw, strategy, run.layers, run.idle_feature)
  stages = stages_of(run, model)
  for st in stages:
    st.warm_up()
  emulator = None
  if hw.emulated:
    if run.hetero is None or c.devices != c.tensor:
      raise ValueError("sim.hardware.emulated: replays one tensor group with its Hetero")
    emulator = emulation.emulator(run.hetero, w.spec, w.tokens_per_replica)
  rng = np.random.default_rng(run.seed)
  trace.reset()
  s_, l_max = c.pipe, max(model.layers)
  tensor_link = hw.link("tensor")
  nominal = nominal_step_s(model)
  steps = run.steps
  step_s = np.zeros(steps)
  features = np.zeros((steps, len(stepcost.OVERHEADS) + 4))
  fixed = np.zeros(steps)
  speed_sum = np.zeros((c.pipe, c.tensor))
  coefs = coefficients(hw)
  ideal = 0.0
  clock = 0.0

  widths_of: dict = {}   # by the plans' `executed` objects, which the stages cache and repeat

  def stage_widths(plans):
    """{kind: float [S, T, L]}: what every stage's devices execute in `plans`."""
    key = tuple(id(p.executed) for p in plans)
    if key not in widths_of:       # (an entry holds the plans' objects: their ids stay theirs)
      widths = {k: np.zeros((s_, c.tensor, l_max)) for k in w.spec.num_units()}
      for i, p in enumerate(plans):
        for k, e in p.executed.items():
          widths[k][i, :, :e.shape[1]] = e
      if len(widths_of) >= stepcost.MEMO_ENTRIES:
        widths_of.clear()
      widths_of[key] = [p.executed for p in plans], widths
    return widths_of[key][1]

  def step_time(step, plans, speeds, links):
    """(the step's `stepcost.StepTime`, its seconds, sampled times float [S, T], each position's
    slowest replica's speed float [S, T])."""
    widths = stage_widths(plans)
    extra = np.array([tensor_link.seconds(p.offload_bytes) if p.offload_bytes else 0.0
                      for p in plans])
    physical = np.ones(c.shape) if emulator is not None else speeds
    t = model.step(widths, [p.kind for p in plans], physical, links, extra)
    seconds = t.seconds
    if hw.step_noise:
      seconds *= float(np.exp(rng.normal(0.0, hw.step_noise)))
    if emulator is not None:
      seconds += emulator.delay_s(step, plans[0].executed)
    position = speeds.min(axis=0)                                     # [S, T]
    noise = np.exp(rng.normal(0.0, hw.sample_noise, position.shape)) if hw.sample_noise else (
        np.ones(position.shape))
    return t, seconds, noise / position, position

  if any(st.sampler is not None and st.script is None for st in stages):
    # Warm-up's timed trial step (`warmup.WarmUp._trial`), at the trace's start, off the clock.
    flat, links = trace.at(0, clock)
    _, seconds, times, _ = step_time(0, [st.plan(0) for st in stages], flat.reshape(c.shape),
                                     links)
    for i, st in enumerate(stages):
      st.trial(0, seconds, times[i])
  for step in range(steps):
    flat, links = trace.at(step, clock)
    speeds = flat.reshape(c.shape)
    plans = [st.before_step(step) for st in stages]
    t, seconds, times, position = step_time(step, plans, speeds, links)
    speed_sum += position
    sampled = False
    for i, st in enumerate(stages):
      sampled |= st.after_step(step, seconds, times[i]) is not None
    move = max(p.move_s for p in plans)
    total = seconds + move + (hw.sample_s if sampled else 0.0)
    step_s[step] = total
    features[step] = t.features
    fixed[step] = total - features[step] @ coefs
    ideal += nominal / float(flat.mean()) if emulator is None else np.nan
    clock += total
  return Result(run.policy, step_s, float(w.tokens_per_replica * c.data), ideal,
                speed_sum / steps,
                [{"stats": dict(st.stats), "counts": st.counts(), "changes": st.changes[:50]}
                 for st in stages], features, fixed, time.perf_counter() - t_start,
                float(np.mean(getattr(strategy, "staleness", None) or [0.0])))


def coefficients(hw: hardware_lib.Hardware) -> np.ndarray:
  """The coefficients of `Result.features` in a step's seconds: the step overhead, 1 / FLOP rate,
  each step variant's overhead / FLOP rate, (1 - 1 / idle speedup) / FLOP rate, and the
  contention wait's seconds."""
  return np.array([hw.step_overhead_s, 1 / hw.device_flops,
                   *(getattr(hw, name) / hw.device_flops for name in stepcost.OVERHEADS.values()),
                   (1 - 1 / hw.idle_speedup) / hw.device_flops, hw.contention_wait_s])


def nominal_step_s(model: stepcost.StepModel) -> float:
  """Seconds of an even, single-width step with every device at speed 1."""
  c = model.cluster
  widths = {}
  for k, units in model.workload.spec.num_units().items():
    w = np.zeros((c.pipe, c.tensor, max(model.layers)))
    for i, layers in enumerate(model.layers):
      w[i, :, :layers] = np.asarray(layout_lib.even_counts(units, c.tensor))[:, None]
    widths[k] = w
  return model.step(widths, ["single"] * c.pipe, np.ones(c.shape), np.ones(c.regions)).seconds
