"""The balancing of one pipeline stage's tensor groups, run by the library's own decision code.

`StageBalancer` does, on simulated time, what `balance.coordinator.Balancer` does in a real run,
in the same order and with the same objects: the policy (`balance.policies.make`), its buckets
(`Policy.buckets`), the step variant of each step (`balance.plans.PlanCache.kind`), the widths
every device executes (`core.plan.executed_widths`), ZERO-resizing's selection
(`balance.priority.Resizer`), and for the controlled policies the cost model built by
`coordinator.cost_model`, the `controller.Controller`, and a `sampling.SpeedSampler` whose
tracker turns samples into regimes. Per step:

  before_step   decide after a new sample (once the cost model is calibrated), migrate if the
                decision moves (`buckets.Buckets.target`, `core.migrate.plan` for the bytes;
                the cost model observes the move's simulated seconds), then the step's setup,
                variant and executed widths;
  after_step    the step's seconds (without migration and sampling, as the loop measures it)
                go to the sampler; a new sample calibrates the cost model
                (`CostModel.observe(setup, sample speeds, mean step seconds)`).

Nothing of the decision logic is copied: a change to the controller, the cost model, the
policies or the tracker changes the simulation. A *scripted* stage (`script`: the setups a
measured run's decision log recorded, by step) takes those setups instead of deciding, and runs
everything else the same way: a replay of what a run did, to check the costs alone. Its cost
model, which serves only the decisions, is not calibrated (that took most of a replay's time).

The stage's tensor positions see the speeds of the slowest replica at each position, as
`balance.speed.tensor_times` gives a real run: one layout serves every data-parallel replica of
the stage (their gradients are all-reduced unit by unit).
"""

from __future__ import annotations

import dataclasses
import time
import types
from typing import Callable

import numpy as np

from semijax.balance import buckets as buckets_lib
from semijax.balance import controller as controller_lib
from semijax.balance import coordinator
from semijax.balance import plans as plans_lib
from semijax.balance import policies as policies_lib
from semijax.balance import priority as priority_lib
from semijax.balance import sampling as sampling_lib
from semijax.balance import settings as settings_lib
from semijax.balance.cost import Setup
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import migrate as migrate_lib
from semijax.core import plan as plan_lib
from semijax.core import spec as spec_lib


class SampledTimes:
  """The speed source a `SpeedSampler` reads when it measures "emulated": the simulator sets
  `times` (float [T], relative time of the same work per tensor position) before each step's
  `after_step`."""

  def __init__(self):
    self.slowdown = ()          # not None: the sampler's "emulated" source
    self.times = None

  def slowdown_at(self, step: int):
    del step
    return self.times


@dataclasses.dataclass
class StepPlan:
  """What a stage runs in one step.

  Attributes:
    executed: {kind: float [T, L]} widths every device executes in each block.
    kind: the step variant ("single", "branched", "resized", "offload").
    move_s: seconds of a migration before the step (0 without).
    offload_bytes: bytes the offload step sends per step (weights out, gradients back).
  """

  executed: dict
  kind: str
  move_s: float = 0.0
  offload_bytes: float = 0.0


class StageBalancer:
  """One stage's balancing on simulated time (see module doc).

  Args:
    settings: the `BalanceSettings` (its `policy` is the policy run).
    resize_spec: the `balance.resize.ResizeSpec`.
    spec: the stage's `ModelSpec` (its `num_layers` are the stage's layers).
    layout: the configured layout (even, or the static split).
    unit_bytes: {kind: bytes of one unit's weights in the stage} (offload traffic).
    move_s: seconds of a migration, from its `core.migrate.Moves`.
    epoch_steps: steps per epoch (a `static` resize schedule's period).
    hetero: the emulated slowdown (`core.emulation.Hetero`) the sampler reads in an emulated
      replay, else None (the simulator sets the sampled times).
    seed: for the random priority.
    script: {0-based step: `cost.Setup`} to take at those steps instead of deciding, or None.
  """

  def __init__(self, settings: settings_lib.BalanceSettings, resize_spec, spec: spec_lib.ModelSpec,
               layout: layout_lib.Layout, unit_bytes: dict,
               move_s: Callable[[migrate_lib.Moves], float], *, epoch_steps: int = 1,
               hetero=None, seed: int = 0, script: dict | None = None):
    self.spec, self.unit_bytes, self.move_s = spec, dict(unit_bytes), move_s
    self.policy = policies_lib.make(settings, resize_spec, epoch_steps)
    self.buckets = self.policy.buckets(layout)
    self.layout = self.buckets.start
    self.plans = plans_lib.PlanCache(None, self.policy, self.buckets)   # variants only
    n = layout.num_devices
    self.resizer = None
    if self.policy.resizes:
      priority = priority_lib.Priority(
          resize_spec, num_layers=spec.num_layers, d_model=spec.d_model,
          num_units=spec.num_units(), unit_sizes=spec.unit_sizes(), num_devices=n, seed=seed)
      self.resizer = priority_lib.Resizer(priority, resize_spec.refresh_every or epoch_steps)
    self.controller = self.sampler = None
    self.source = SampledTimes()
    if self.policy.controlled:
      engine = types.SimpleNamespace(num_units=spec.num_units())
      cost = coordinator.cost_model(engine, spec, settings, resize_spec, self.buckets)
      self.controller = controller_lib.Controller(
          self.policy, settings, cost, self.policy.initial_setup(self.buckets.start),
          buckets_lib.capacities(self.buckets.big), self.unit_bytes)
      emulated = hetero is not None
      mesh = types.SimpleNamespace(shape={mesh_lib.TENSOR: n})
      self.sampler = sampling_lib.SpeedSampler(
          dataclasses.replace(settings, measure="emulated"), hetero if emulated else self.source,
          mesh)
      # An emulated run samples every step (its profile is known); a real one every probe_every.
      self.sampler.every = 1 if emulated else settings.probe_every
    self.stats = {"migrations": 0, "move_s": 0.0, "decisions": 0, "changes": 0,
                  "decide_s": 0.0, "resized_steps": 0, "steps": 0}
    self.changes: list[dict] = []
    self.script = script
    self._sample = None
    self._new_regime = False
    self._executed: dict = {}
    self._layout_key = (None, None)    # (layout, its part of a `_widths` key)

  # --- warm-up --------------------------------------------------------------------------------

  def warm_up(self) -> None:
    """What `Balancer.warm_up` leaves the cost model with: the timed move (start -> an uneven
    split one unit away, in the big bucket)."""
    if self.policy.moves:
      there = self.buckets.warm_target(self.layout)
      self.controller.cost.observe_move(self.move_s(migrate_lib.plan(self.layout, there)))

  # --- per step -------------------------------------------------------------------------------

  def setup(self, step: int) -> Setup:
    if self.controller is not None:
      return self.controller.setup
    counts = {k: u.counts for k, u in self.layout.kinds().items()}
    return Setup(counts, counts, self.policy.keep(step, self.layout.num_devices))

  def before_step(self, step: int) -> StepPlan:
    """Decides (after a new sample), migrates if the decision says so; the step's plan."""
    move_s = 0.0
    if self.script is not None:
      if self.controller is not None and step in self.script:
        move_s = self._take_scripted(step, self.script[step])
    elif self._sample is not None and self.controller.cost.calibrated:
      self._sample = None
      t0 = time.perf_counter()
      d = self.controller.decide(step, self.sampler.tracker.speeds,
                                 self.sampler.expected_remaining_s(), self.sampler.step_s,
                                 new_regime=self._new_regime)
      self.stats["decide_s"] += time.perf_counter() - t0
      self._new_regime = False
      self.stats["decisions"] += 1
      if d.changed:
        self.stats["changes"] += 1
        self.changes.append({"step": step, "choice": d.choice, "moves": d.moves,
                             "reason": d.reason, **d.setup.describe()})
      if d.moves:
        move_s = self._migrate(d.setup.owned)
    plan = self.plan(step, move_s)
    self.stats["steps"] += 1
    self.stats["resized_steps"] += plan.kind == "resized"
    return plan

  def plan(self, step: int, move_s: float = 0.0) -> StepPlan:
    """The plan of 0-based `step` in the current layout and setup, deciding nothing."""
    setup = self.setup(step)
    resize, version = None, 0
    if self.resizer is not None:
      resize, version = self.resizer.resize(self.layout, setup.keep), self.resizer.version
    kind = self.plans.kind(self.layout, setup)
    offload = 0.0
    if kind == "offload":
      offload = self.controller.cost.offload_bytes(setup, self.unit_bytes)
    return StepPlan(self._widths(kind, setup, resize, version), kind, move_s, offload)

  def _widths(self, kind: str, setup: Setup, resize, version: int) -> dict:
    """`core.plan.executed_widths` of the step (cached like `PlanCache.plan`)."""
    layout = self.layout
    if self._layout_key[0] is not layout:              # (a run keeps its layout for many steps)
      self._layout_key = layout, tuple((k, u.capacity, u.counts)
                                       for k, u in layout.kinds().items())
    key = (self._layout_key[1], kind,
           setup.keep, tuple(sorted(setup.computed.items())) if kind == "offload" else None,
           version if kind == "resized" else None)
    if key not in self._executed:
      if len(self._executed) >= plans_lib.PLAN_CACHE_SIZE:
        self._executed.clear()
      # The plan cache's own arguments of this variant (it builds device plans; this needs
      # only the host widths).
      args = plans_lib.PlanCache._arguments(  # pylint: disable=protected-access
          layout, kind, setup, resize)
      self._executed[key] = plan_lib.executed_widths(layout, self.spec.num_layers, **args)
    return self._executed[key]

  def _take_scripted(self, step: int, setup: Setup) -> float:
    """A recorded decision's setup, migrating when its ownership differs (what `decide` would
    have returned)."""
    move_s = self._migrate(setup.owned) if setup.owned != self.controller.setup.owned else 0.0
    if setup != self.controller.setup:
      self.stats["changes"] += 1
      self.changes.append({"step": step, "choice": "scripted", **setup.describe()})
    self.controller.setup = setup
    self.stats["decisions"] += 1
    return move_s

  def _migrate(self, counts: dict) -> float:
    new = self.buckets.target(self.layout, counts)
    seconds = self.move_s(migrate_lib.plan(self.layout, new))
    self.stats["migrations"] += 1
    self.stats["move_s"] += seconds
    self.controller.cost.observe_move(seconds)
    self.layout = new
    return seconds

  def after_step(self, step: int, step_s: float, times=None):
    """Takes the step's seconds and (simulated runs) the sampled times float [T] of this stage's
    positions; returns a new `sampling.Sample` or None."""
    if self.sampler is None:
      return None
    self.source.times = times
    sample = self.sampler.after_step(step, step_s)
    if sample is not None:
      self._sample = sample
      self._new_regime |= sample.new_regime
      if self.script is None:                       # (a scripted stage decides nothing)
        self.controller.cost.observe(self.controller.setup, sample.speeds, sample.mean_s)
    return sample

  def trial(self, step: int, step_s: float, times=None) -> None:
    """What `Balancer.warm_up`'s timed trial step does: a provisional sample of one step in the
    starting layout (`step_s` seconds, sampled `times` float [T]) before 0-based `step`, the
    first to run, which then runs on a decision. Not with a script (it has its own steps)."""
    if self.sampler is None or self.script is not None:
      return
    self.source.times = times
    sample = self.sampler.trial(step, step_s)
    self._sample = sample
    self._new_regime |= sample.new_regime
    self.controller.cost.observe(self.controller.setup, sample.speeds, sample.mean_s)

  def counts(self) -> dict:
    return {k: list(u.counts) for k, u in self.layout.kinds().items()}


def stage_spec(spec: spec_lib.ModelSpec, layers: int) -> spec_lib.ModelSpec:
  """The spec of a pipeline stage with `layers` of the model's blocks."""
  return dataclasses.replace(spec, num_layers=int(layers))


def oracle_counts(spec: spec_lib.ModelSpec, speeds) -> dict:
  """{kind: counts}: the static oracle's split of a stage, proportional to `speeds` float [T]
  (`core.layout.proportional_counts`, at least one unit each)."""
  speeds = np.asarray(speeds, np.float64)
  return {k: layout_lib.proportional_counts(u, speeds / speeds.max())
          for k, u in spec.num_units().items()}
