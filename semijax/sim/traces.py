"""Straggler scenarios: device speeds and region links over time, as config (`SCENARIOS`).

A `Trace` is a list of piecewise-constant changes: at time t (seconds of the simulated clock,
or steps) device d runs at relative speed v (1 = nominal), or region g's outgoing links carry
a factor f of their bandwidth. The simulator asks `Trace.at(step, clock_s)` before every step
(speeds are constant within a step) and gets float [D] speeds and float [regions] link
factors. A trace is written and read as JSON (`to_json`, `from_json`; the `replay` scenario):

  {"unit": "s" | "step", "num_devices": D, "regions": G,
   "events": [[at, device, speed], ...], "link_events": [[at, region, factor], ...]}

A scenario is built for a `Shape`: D devices in G regions, `replica_devices` per data-parallel
replica (replica r holds ids [r x that, (r + 1) x that), as `cluster.Cluster` numbers them).

Scenarios (`build(name, params, ...)`; each parameter has a default, `SCENARIOS[name]`):

  none        every device at speed 1.
  persistent  a fixed share of the devices is slow for the whole run: mixed device generations
              or a throttled part (the heterogeneous clusters of HARP/Metis; the FlexTP paper's
              static profile (8, 6, 4, 2, 1, ...) is the extreme of it).
  bursts      every device alternates between normal and slow periods with exponential
              durations, so that a share `busy` is slow at any time: co-located tenants and CPU
              contention. The slow speed is what this machine measured for a process sharing its
              core with one CPU-bound competitor (the scheduler share of the straggler benchmark,
              0.37-0.45; 0.4 here).
  rotating    the FlexTP paper's dynamic straggler: a few devices much slower (8x, as in its
              experiments), each jumping to another random device every `period_s`.
  fail_slow   FALCON's fail-slows (Wu et al., arXiv 2410.12588 / Greyhound, ATC'25: a 10,000-GPU
              production cluster): computation fail-slows (CPU contention, GPU thermal throttling)
              that last from tens of seconds to hours. A share of the devices starts to degrade at
              a random time in the first half of the run, its speed decaying linearly to `floor`
              over `decay_s`, and stays degraded.
  fail_slow_1pct  a computation fail-slow at its extreme: a device that keeps running at 1% of
              its speed (hardware slowdown under thermal throttling, a failing part), the case
              draining a device is for. In a share of the data-parallel replicas one device each
              (uniformly among the replica's devices) drops to `speed` at a random time in the
              first `onset` of the run and stays there. Its `share` is of replicas, so 1/8 of the
              study's replicas of 32 devices is fail_slow's 1/256 of the devices. One throttled
              H100 of 16 cut an FSDP fine-tuning's throughput 5x (J. Zhang, "Impact of GPU
              Thermal Throttling on LLM Training", Azure ND H100 v5); 1% is this project's
              choice of the extreme.
  slow_link   FALCON's commonest and costliest cause, cross-node network congestion: the links of
              region 0 carry `factor` of their bandwidth from `start` to `end` (shares of the run).
              Needs a cluster with at least 2 regions for data-parallel traffic to cross it.
  replay      a trace file (`path`): measured speeds, e.g. the straggler benchmark's contention
              intervals (`semijax.sim.calibrate`) or a cluster's monitoring export.

The shares and durations are parameters; the defaults are this project's assumptions where the
sources give no number (FALCON gives durations and causes, not the share of slow devices at a
time: "a few slow devices at any time" is taken as about 1%).
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from semijax.errors import ConfigError

UNITS = ("s", "step")


@dataclasses.dataclass
class Trace:
  """Piecewise-constant device speeds and region link factors (see module doc).

  Attributes:
    num_devices: D; regions: G.
    events: float [E, 3] rows (at, device, speed), sorted by `at`.
    link_events: float [F, 3] rows (at, region, factor), sorted by `at`.
    unit: "s" (the simulated clock) or "step" (0-based steps) for `at`.
  """

  num_devices: int
  regions: int = 1
  events: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 3)))
  link_events: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros((0, 3)))
  unit: str = "s"

  def __post_init__(self):
    if self.unit not in UNITS:
      raise ConfigError(f"sim.trace.unit: {self.unit!r} is not one of {list(UNITS)}")
    self.events = _sorted_rows(self.events, "events", self.num_devices, positive=True)
    self.link_events = _sorted_rows(self.link_events, "link_events", self.regions, positive=True)
    self.reset()

  def reset(self) -> None:
    """Back to time 0 (every device at speed 1, every link at full bandwidth)."""
    self._speeds = np.ones(self.num_devices)
    self._links = np.ones(self.regions)
    self._next = 0
    self._next_link = 0

  def at(self, step: int, clock_s: float) -> tuple[np.ndarray, np.ndarray]:
    """(speeds float [D], link factors float [G]) in force at 0-based `step` / `clock_s`;
    calls must not go back in time (`reset` first)."""
    now = step if self.unit == "step" else clock_s
    e, i = self.events, self._next
    while i < len(e) and e[i, 0] <= now + 1e-12:
      self._speeds[int(e[i, 1])] = e[i, 2]
      i += 1
    self._next = i
    le, j = self.link_events, self._next_link
    while j < len(le) and le[j, 0] <= now + 1e-12:
      self._links[int(le[j, 1])] = le[j, 2]
      j += 1
    self._next_link = j
    return self._speeds, self._links

  def to_json(self) -> dict:
    return {"unit": self.unit, "num_devices": self.num_devices, "regions": self.regions,
            "events": [[float(a), int(d), float(v)] for a, d, v in self.events],
            "link_events": [[float(a), int(g), float(f)] for a, g, f in self.link_events]}

  @classmethod
  def from_json(cls, d: dict, *, num_devices: int | None = None, regions: int | None = None,
                field: str = "sim.trace") -> "Trace":
    """A trace from its JSON form; `num_devices` / `regions`, if given, must match it."""
    if not isinstance(d, dict):
      raise ConfigError(f"{field}: expected an object, got {type(d).__name__}")
    n = d.get("num_devices")
    if not isinstance(n, int) or n < 1:
      raise ConfigError(f"{field}.num_devices: must be an integer >= 1, got {n!r}")
    if num_devices is not None and n != num_devices:
      raise ConfigError(f"{field}.num_devices: the trace has {n} devices, the cluster "
                        f"{num_devices}")
    g = d.get("regions", 1)
    if regions is not None and g != regions:
      raise ConfigError(f"{field}.regions: the trace has {g} regions, the cluster {regions}")
    return cls(n, g, np.asarray(d.get("events", []), np.float64).reshape(-1, 3),
               np.asarray(d.get("link_events", []), np.float64).reshape(-1, 3),
               d.get("unit", "s"))

  def mean_speeds(self, times) -> np.ndarray:
    """float [D]: the mean speed of every device over the instants `times` (same unit)."""
    self.reset()
    out = np.zeros(self.num_devices)
    for t in times:
      out += self.at(int(t), float(t))[0]
    self.reset()
    return out / max(len(times), 1)


def _sorted_rows(rows, name: str, limit: int, positive: bool) -> np.ndarray:
  rows = np.asarray(rows, np.float64).reshape(-1, 3)
  if len(rows):
    bad = ~np.isfinite(rows).all(1) | (rows[:, 0] < 0) | (rows[:, 1] < 0) | (rows[:, 1] >= limit)
    bad |= (rows[:, 2] <= 0) if positive else False
    if bad.any():
      r = rows[np.argmax(bad)].tolist()
      raise ConfigError(f"sim.trace.{name}: bad row {r}: need at >= 0, an index in [0, {limit}) "
                        "and a positive value")
  return rows[np.argsort(rows[:, 0], kind="stable")]


# --- scenarios ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
  """The devices a scenario is built for: `num_devices` D in `regions` G, `replica_devices` per
  data-parallel replica (contiguous ids; D when there is one replica)."""

  num_devices: int
  regions: int
  replica_devices: int

  def __post_init__(self):
    r = self.replica_devices
    if isinstance(r, bool) or not isinstance(r, int) or r < 1 or self.num_devices % r:
      raise ConfigError(f"sim.trace.replica_devices: {r!r} devices per replica do not divide "
                        f"{self.num_devices} devices")

  @property
  def replicas(self) -> int:
    return self.num_devices // self.replica_devices


def _count(num_devices: int, share: float) -> int:
  return max(1, int(round(share * num_devices)))


def _none(rng, shape, duration_s, p):
  del rng, duration_s, p
  return Trace(shape.num_devices, shape.regions)


def _persistent(rng, shape, duration_s, p):
  del duration_s
  n = shape.num_devices
  slow = rng.choice(n, _count(n, p["share"]), replace=False)
  return Trace(n, shape.regions, [[0.0, d, p["speed"]] for d in slow])


def _bursts(rng, shape, duration_s, p):
  n = shape.num_devices
  busy, mean_s = p["busy"], p["mean_s"]
  off_mean = mean_s * (1 - busy) / busy
  rows = []
  for d in range(n):
    t = rng.exponential(off_mean) * rng.random()      # a random phase of the first quiet period
    while t < duration_s:
      on = rng.exponential(mean_s)
      rows += [[t, d, p["speed"]], [t + on, d, 1.0]]
      t += on + rng.exponential(off_mean)
  return Trace(n, shape.regions, rows)


def _rotating(rng, shape, duration_s, p):
  n = shape.num_devices
  rows, current = [], list(rng.choice(n, _count(n, p["share"]), replace=False))
  t = 0.0
  while t < duration_s:
    for i, d in enumerate(current):
      new = int(rng.integers(n))
      if t > 0:
        rows.append([t, d, 1.0])
      rows.append([t, new, p["speed"]])
      current[i] = new
    t += p["period_s"]
  return Trace(n, shape.regions, rows)


def _fail_slow(rng, shape, duration_s, p):
  n = shape.num_devices
  rows = []
  steps = max(int(p["steps"]), 1)
  for d in rng.choice(n, _count(n, p["share"]), replace=False):
    onset = rng.uniform(0, 0.5 * duration_s)
    for i in range(1, steps + 1):
      rows.append([onset + p["decay_s"] * i / steps, d, 1.0 - (1.0 - p["floor"]) * i / steps])
  return Trace(n, shape.regions, rows)


def _fail_slow_1pct(rng, shape, duration_s, p):
  rows = []
  size = shape.replica_devices
  for r in rng.choice(shape.replicas, _count(shape.replicas, p["share"]), replace=False):
    device = r * size + int(rng.integers(size))
    rows.append([rng.uniform(0, p["onset"] * duration_s), device, p["speed"]])
  return Trace(shape.num_devices, shape.regions, rows)


def _slow_link(rng, shape, duration_s, p):
  del rng
  if shape.regions < 2:
    raise ConfigError("sim.scenario.slow_link: needs a cluster of at least 2 regions "
                      f"(sim.cluster.regions = {shape.regions})")
  return Trace(shape.num_devices, shape.regions,
               link_events=[[p["start"] * duration_s, 0, p["factor"]],
                            [p["end"] * duration_s, 0, 1.0]])


def _replay(rng, shape, duration_s, p):
  del rng, duration_s
  if not p.get("path"):
    raise ConfigError("sim.scenario.replay.path: the trace file to replay is required")
  with open(p["path"]) as f:
    return Trace.from_json(json.load(f), num_devices=shape.num_devices, regions=shape.regions,
                           field=f"sim.scenario.replay({p['path']})")


@dataclasses.dataclass(frozen=True)
class Scenario:
  """A scenario's builder, `build(rng, shape: Shape, duration_s, params) -> Trace`, and its
  parameters' defaults (see module doc)."""

  build: object
  defaults: dict


SCENARIOS = {
    "none": Scenario(_none, {}),
    "persistent": Scenario(_persistent, {"share": 0.01, "speed": 0.5}),
    "bursts": Scenario(_bursts, {"busy": 0.01, "mean_s": 30.0, "speed": 0.4}),
    "rotating": Scenario(_rotating, {"share": 1 / 512, "speed": 0.125, "period_s": 60.0}),
    "fail_slow": Scenario(_fail_slow, {"share": 1 / 256, "floor": 0.3, "decay_s": 120.0,
                                       "steps": 12}),
    "fail_slow_1pct": Scenario(_fail_slow_1pct, {"share": 1 / 8, "speed": 0.01, "onset": 0.25}),
    "slow_link": Scenario(_slow_link, {"factor": 0.1, "start": 0.25, "end": 0.75}),
    "replay": Scenario(_replay, {"path": ""}),
}


def build(name: str, params: dict | None, *, num_devices: int, regions: int, duration_s: float,
          seed: int = 0, replica_devices: int | None = None) -> Trace:
  """The trace of scenario `name` with `params` over `duration_s` seconds, for `num_devices`
  in `regions` with `replica_devices` per data-parallel replica (default all: one replica);
  ConfigError naming a bad scenario or parameter."""
  if name not in SCENARIOS:
    raise ConfigError(f"sim.scenario: {name!r} is not one of {list(SCENARIOS)}")
  s = SCENARIOS[name]
  params = dict(params or {})
  unknown = sorted(set(params) - set(s.defaults))
  if unknown:
    raise ConfigError(f"sim.scenario.{name}.{unknown[0]}: unknown parameter; known: "
                      f"{sorted(s.defaults)}")
  p = {**s.defaults, **params}
  for k, v in p.items():
    if k == "path":
      continue
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
      raise ConfigError(f"sim.scenario.{name}.{k}: must be a positive number, got {v!r}")
    if k in ("share", "busy", "speed", "floor", "factor", "start", "end", "onset") and v > 1:
      raise ConfigError(f"sim.scenario.{name}.{k}: must be in (0, 1], got {v!r}")
  if not duration_s > 0:
    raise ValueError(f"duration_s must be positive, got {duration_s}")
  shape = Shape(num_devices, regions, num_devices if replica_devices is None else replica_devices)
  return s.build(np.random.default_rng(seed), shape, float(duration_s), p)
