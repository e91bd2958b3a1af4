"""What a simulated device and its links cost (`Hardware`), and the constants file that holds them.

A `Hardware` profile is a handful of numbers: the FLOP rate of a device in the blocks' GEMMs,
what the branched and offload steps add to it, a per-step overhead that no split changes, device
memory bandwidth (the optimizer update), the links between devices at each level of the cluster
(`Link`: latency and bandwidth), what a migration and a speed sample cost, and how noisy one
speed sample is.

Profiles fitted from this machine's measured runs (`semijax.sim.calibrate`) and profiles of
hardware that cannot be measured here (nominal numbers, each with its source) live in one JSON
file, `benchmarks/measurements/sim_constants.json`:

  {"version": 1, "profiles": {name: {field: value, "links": {level: {...}}}}, "fit": {...}}

`load` reads it and checks every field (`ConfigError` naming the field); `save` writes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers

from semijax.errors import ConfigError

# Link levels, from the fastest to the slowest: inside a tensor group (one node), between the
# stages of a pipeline, between data-parallel replicas of one region, between regions.
LEVELS = ("tensor", "pipe", "data", "region")
VERSION = 1
# The most a device can gain from idle partners: one hyperthread alone gets the whole core (2x).
MAX_IDLE_SPEEDUP = 2.0


@dataclasses.dataclass(frozen=True)
class Link:
  """One class of link: a message of b bytes takes `latency_s + b / bytes_per_s`."""

  latency_s: float = 0.0
  bytes_per_s: float = math.inf

  def seconds(self, nbytes, factor=1.0):
    """Seconds of one message of `nbytes` (array or scalar) at `factor` x the bandwidth."""
    return self.latency_s + nbytes / (self.bytes_per_s * factor)


@dataclasses.dataclass(frozen=True)
class Hardware:
  """The costs of one kind of cluster (see module doc).

  Attributes:
    name: the profile's name in the constants file.
    device_flops: FLOP/s of one device at speed 1 in the blocks' GEMMs (and the repeated layers).
    branch_overhead: extra block compute of the branched step (a `lax.switch` over widths that
      rematerializes the forward pass), relative (the library's cost model assumes
      `cost.BRANCH_OVERHEAD`; this is what was measured).
    resize_overhead: extra block compute of the resized step (branches, kept-unit gathers,
      imputation), relative.
    offload_overhead: extra block compute of the offload step, relative.
    step_overhead_s: seconds per step that no split and no device speed changes (dispatch, host
      work, and, for the fitted profiles, the collectives of the measured configuration).
    contention_wait_s: seconds a step adds per unit of a competitor's share of a device's core
      (1 - its speed; the slowest device of a replica): a process that shares its core with a
      CPU-bound competitor wakes up late from each of the step's collectives, when the competitor
      holds the core. 0 = devices have no competitor (accelerators).
    memory_bytes_per_s: device memory bandwidth: the optimizer update reads and writes the
      parameters, gradients and moments (infinite: the update is inside the fitted terms).
    cores: devices that share one host's cores (fake devices): a block then takes at least its
      summed work over `cores`; 0 = every device computes on its own.
    idle_speedup: how many times faster a device at full speed computes while other full-speed
      devices of its tensor group wait for it (>= 1): their cores' share of a physical core they
      share goes to it (this machine's 2 vCPUs are the two hyperthreads of one core). A device
      slowed by a competitor (speed < 1) leaves its core to the competitor when it waits.
      1 = devices do not share compute (accelerators); at most `MAX_IDLE_SPEEDUP`.
    emulated: slowdowns are the emulated host sleep (`core.emulation`), not slower devices.
    links: {level: Link} for `LEVELS`.
    move_fixed_s: fixed seconds of one migration.
    move_local_bytes_per_s: rate of a migration's local gathers over the device's unit state.
    move_bytes_per_s: bandwidth of the migration collective for the bytes it carries.
    sample_s: seconds one shared speed sample adds to its step.
    sample_noise: standard deviation of log(measured / true time) of one speed sample.
    step_noise: standard deviation of log(step time / its model), step to step (a shared host's
      jitter; what the cost model's online fit sees).
    source: where the numbers come from (fit, measurement or datasheet).
  """

  name: str
  device_flops: float
  branch_overhead: float = 0.0
  resize_overhead: float = 0.0
  offload_overhead: float = 0.0
  step_overhead_s: float = 0.0
  contention_wait_s: float = 0.0
  memory_bytes_per_s: float = math.inf
  cores: int = 0
  idle_speedup: float = 1.0
  emulated: bool = False
  links: dict = dataclasses.field(default_factory=dict)
  move_fixed_s: float = 0.0
  move_local_bytes_per_s: float = math.inf
  move_bytes_per_s: float = math.inf
  sample_s: float = 0.0
  sample_noise: float = 0.0
  step_noise: float = 0.0
  source: str = ""

  def link(self, level: str) -> Link:
    return self.links.get(level, Link())

  def to_json(self) -> dict:
    out = dataclasses.asdict(self)
    out["links"] = {k: _finite(dataclasses.asdict(v)) for k, v in self.links.items()}
    return _finite(out)

  @classmethod
  def from_json(cls, name: str, d: dict) -> "Hardware":
    """A profile from its JSON form; ConfigError names the first bad field."""
    f = f"sim.profiles.{name}"
    if not isinstance(d, dict):
      raise ConfigError(f"{f}: expected an object, got {d!r}")
    known = {x.name for x in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
      raise ConfigError(f"{f}.{unknown[0]}: unknown field; known: {sorted(known)}")
    if "device_flops" not in d:
      raise ConfigError(f"{f}.device_flops: missing")
    values = {k: v for k, v in d.items() if k not in ("links", "name")}
    for key, v in values.items():
      if key in ("source",):
        continue
      if key == "emulated":
        if not isinstance(v, bool):
          raise ConfigError(f"{f}.emulated: must be true or false, got {v!r}")
        continue
      v = _number(v)
      positive = key in ("device_flops", "memory_bytes_per_s", "move_local_bytes_per_s",
                         "move_bytes_per_s")
      if v is None or v < 0 or (positive and v == 0) or (key == "cores" and v != int(v)):
        raise ConfigError(f"{f}.{key}: must be a {'positive' if positive else 'non-negative'} "
                          f"{'integer' if key == 'cores' else 'number'}, got {d[key]!r}")
      if key == "idle_speedup" and not 1 <= v <= MAX_IDLE_SPEEDUP:
        raise ConfigError(f"{f}.idle_speedup: must be in [1, {MAX_IDLE_SPEEDUP}], got {d[key]!r}")
      values[key] = int(v) if key == "cores" else v
    links = {}
    for level, ld in (d.get("links") or {}).items():
      if level not in LEVELS:
        raise ConfigError(f"{f}.links.{level}: unknown level; known: {list(LEVELS)}")
      lat, bw = _number(ld.get("latency_s", 0.0)), _number(ld.get("bytes_per_s", math.inf))
      if lat is None or lat < 0:
        raise ConfigError(f"{f}.links.{level}.latency_s: must be >= 0, got {ld.get('latency_s')!r}")
      if bw is None or bw <= 0:
        raise ConfigError(f"{f}.links.{level}.bytes_per_s: must be positive, got "
                          f"{ld.get('bytes_per_s')!r}")
      links[level] = Link(lat, bw)
    return cls(name=name, links=links, **values)


def _number(v):
  """v as a float (null means infinity), or None if it is not a number."""
  if v is None:
    return math.inf
  if isinstance(v, bool) or not isinstance(v, numbers.Real) or math.isnan(v):
    return None
  return float(v)


def _finite(d: dict) -> dict:
  """JSON has no infinity: write it as null (read back as infinity)."""
  return {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in d.items()}


@dataclasses.dataclass(frozen=True)
class Constants:
  """The constants file: profiles by name, and what the fit recorded (errors, provenance)."""

  profiles: dict
  fit: dict = dataclasses.field(default_factory=dict)

  def profile(self, name: str) -> Hardware:
    if name not in self.profiles:
      raise ConfigError(f"sim.hardware: {name!r} is not one of {sorted(self.profiles)}")
    return self.profiles[name]

  def replace(self, **profiles: Hardware) -> "Constants":
    return Constants({**self.profiles, **profiles}, self.fit)

  def to_json(self) -> dict:
    return {"version": VERSION, "profiles": {k: v.to_json() for k, v in self.profiles.items()},
            "fit": self.fit}


def parse(d: dict) -> Constants:
  """Constants from the file's JSON form (ConfigError naming the first bad field)."""
  if not isinstance(d, dict) or d.get("version") != VERSION:
    got = d.get("version") if isinstance(d, dict) else d
    raise ConfigError(f"sim.version: expected {VERSION}, got {got!r}")
  profiles = d.get("profiles")
  if not isinstance(profiles, dict) or not profiles:
    raise ConfigError("sim.profiles: expected an object of hardware profiles")
  return Constants({k: Hardware.from_json(k, v) for k, v in profiles.items()},
                   dict(d.get("fit") or {}))


def load(path: str) -> Constants:
  with open(path) as f:
    return parse(json.load(f))


def save(constants: Constants, path: str) -> None:
  with open(path, "w") as f:
    json.dump(constants.to_json(), f, indent=1, sort_keys=True)
    f.write("\n")
