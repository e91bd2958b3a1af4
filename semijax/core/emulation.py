"""Emulated heterogeneity: slow devices as a delay proportional to the work they really do.

On one host the fake CPU devices share the cores, so extra *compute* on one device slows all of
them. A *sleep* costs no CPU, so sleeping, per block, for the extra time its slowest device would
take makes the step wait like a real straggler in a TP group (docs/uneven_tp.md): every block
ends in an all-reduce, so a block takes as long as its slowest device. A device with slowdown s that
executes width w in a block takes `unit_ms * w * s` (forward plus backward, `unit_ms`); after
each train step the host sleeps the sum over blocks of the largest such time (`Emulator`), from
the widths the step executed (`core.plan.executed_widths`).

The sleep is on the host, not inside the compiled step: a program that calls back to the host
cannot be stored in JAX's persistent compilation cache (and one callback per block and device
costs host time every step). The sum over blocks of the per-block maximum is exactly what
per-block sleeps before each all-reduce would add to a step whose real compute is the same on
every device.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Sequence

import numpy as np

from semijax.core import plan as plan_lib
from semijax.core import schedule as schedule_lib
from semijax.errors import ConfigError

# Backward costs about twice the forward: a delay charged for the forward alone is three times it.
FWD_BWD_FACTOR = 3.0


def unit_ms(flops: dict, tokens_per_device: int, device_gflops: float) -> dict:
  """Emulated milliseconds (forward + backward) per unit of each kind at speed 1.

  Args:
    flops: {kind: forward FLOPs per token of one unit} (`core.spec.ModelSpec.flops_per_unit`).
    tokens_per_device: tokens of one step's local batch.
    device_gflops: the emulated FLOP rate of a device at speed 1.
  """
  if device_gflops <= 0:
    raise ValueError(f"hetero.device_gflops: must be positive, got {device_gflops}")
  return {k: FWD_BWD_FACTOR * f * tokens_per_device / (device_gflops * 1e9) * 1e3
          for k, f in flops.items()}


@dataclasses.dataclass(frozen=True)
class Hetero:
  """Emulated heterogeneity (`config.hetero`).

  Attributes:
    slowdown: one factor per tensor device (4.0 = four times slower), or None for none.
    device_gflops: the emulated FLOP rate of a nominal device.
    rotate_every: steps between shifts of the profile by one device (0 = static): (8, 1, ..., 1)
      rotating is the authors' dynamic straggler.
    repeated: also charge the work outside the blocks that every tensor device repeats, at the
      slowest device that runs it (`Emulator.edge_ms`); False charges the blocks alone.
  """

  slowdown: tuple[float, ...] | None = None
  device_gflops: float = 2.0
  rotate_every: int = 0
  repeated: bool = True

  def validate(self, num_devices: int) -> "Hetero":
    """Raises ConfigError naming the field unless this fits `num_devices` tensor devices."""
    f = "config.hetero"
    if self.slowdown is not None:
      bad = [s for s in self.slowdown if isinstance(s, bool) or not isinstance(s, (int, float))
             or not math.isfinite(s) or s <= 0]
      if bad:
        raise ConfigError(f"{f}.slowdown: every factor must be a positive finite number, got "
                          f"{bad[0]!r} in {self.slowdown}")
      if len(self.slowdown) != num_devices:
        raise ConfigError(f"{f}.slowdown: {len(self.slowdown)} factors {self.slowdown} for "
                          f"mesh.tensor = {num_devices} devices; give one per device or ()")
    g = self.device_gflops
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
      raise ConfigError(f"{f}.device_gflops: must be a positive number, got {g!r}")
    r = self.rotate_every
    if isinstance(r, bool) or not isinstance(r, int) or r < 0:
      raise ConfigError(f"{f}.rotate_every: must be an integer >= 0, got {r!r}")
    if not isinstance(self.repeated, bool):
      raise ConfigError(f"{f}.repeated: must be True or False, got {self.repeated!r}")
    return self

  def slowdown_at(self, step: int) -> tuple[float, ...] | None:
    """The emulated slowdown [N] in 0-based `step`: the profile shifted by one device every
    `rotate_every` steps, or None without emulation."""
    if self.slowdown is None:
      return None
    if not self.rotate_every:
      return tuple(self.slowdown)
    shift = (step // self.rotate_every) % len(self.slowdown)
    return tuple(np.roll(np.asarray(self.slowdown, float), shift).tolist())


def emulator(hetero: Hetero, spec, tokens_per_device: int) -> "Emulator":
  """The emulator of `hetero` for a model of spec `spec` (`core.spec.ModelSpec`) computing
  `tokens_per_device` tokens a step: its blocks' units, and, with `hetero.repeated`, the work
  every device repeats (`ModelSpec.edge_flops`)."""
  ms = lambda flops: unit_ms(flops, tokens_per_device, hetero.device_gflops)
  return Emulator(hetero, ms(spec.flops_per_unit()), ms(spec.edge_flops()) if hetero.repeated
                  else {})


@dataclasses.dataclass(frozen=True)
class Emulator:
  """The emulated slowdown of a run (see module doc).

  Attributes:
    hetero: the slowdown profile over time.
    unit_ms: {kind: emulated milliseconds per unit of executed width at slowdown 1} (`unit_ms`).
    edge_ms: emulated milliseconds at slowdown 1 of the work outside the blocks that every
      tensor device repeats (`unit_ms` of `ModelSpec.edge_flops`): {"first": the embedding,
      "last": the final norm, the head and the loss}, both of which a drained device skips
      (`core.repeated`); {} charges none (replays of runs emulated without it).
  """

  hetero: Hetero
  unit_ms: dict
  edge_ms: dict = dataclasses.field(default_factory=dict)

  def delay_s(self, step: int, executed: dict) -> float:
    """Seconds the slowest devices add to 0-based `step`, which executes `executed`
    ({kind: [N, L]} widths, `core.plan.executed_widths`): the sum over blocks of the largest
    per-device time, plus the repeated work on the slowest device that runs it (a device that
    executes nothing in any block is drained: it skips the embedding, the head and the loss)."""
    slowdown = np.asarray(self.hetero.slowdown_at(step), np.float64)
    ms = sum(float((self.unit_ms[k] * np.asarray(e) * slowdown[:, None]).max(axis=0).sum())
             for k, e in executed.items())
    busy = plan_lib.executes(executed)
    edge = self.edge_ms.get("first", 0.0) + self.edge_ms.get("last", 0.0)
    ms += edge * slowdown[busy].max(initial=0.0)
    return ms / 1e3

  @staticmethod
  def sleep(seconds: float) -> None:
    if seconds > 0:
      time.sleep(seconds)



@dataclasses.dataclass(frozen=True, eq=False)
class Devices:
  """Emulated devices and links of a pipelined run (`config.hetero.device_speeds`, `.links`).

  Attributes:
    speeds: float [N] relative speed of each device, by device id (1 = `device_gflops`).
    latency_s: float [N, N] link latency in seconds between two devices (diagonal unused).
    bandwidth: float [N, N] link bandwidth in bytes/s (inf: a free link).
    regions: int [N] the region of each device, or None.
  """

  speeds: np.ndarray
  latency_s: np.ndarray
  bandwidth: np.ndarray
  regions: np.ndarray | None = None

  @classmethod
  def from_regions(cls, speeds, regions, region_latency_s, region_bandwidth) -> "Devices":
    """Devices with a region index each; links from R x R region matrices (diagonal: inside a
    region)."""
    regions = np.asarray(regions, np.int64)
    lat = np.asarray(region_latency_s, np.float64)[np.ix_(regions, regions)]
    bw = np.asarray(region_bandwidth, np.float64)[np.ix_(regions, regions)]
    return cls(np.asarray(speeds, np.float64), lat, bw, regions)

  def with_speeds(self, speeds) -> "Devices":
    """These links with other speeds [N]."""
    return dataclasses.replace(self, speeds=np.asarray(speeds, np.float64))

  def speeds_at(self, step: int, rotate_every: int) -> np.ndarray:
    """float [N]: the speeds in 0-based `step`, shifted by one device id every `rotate_every`
    steps (0: static), as `Hetero.slowdown_at` shifts a slowdown profile."""
    if not rotate_every:
      return self.speeds.copy()
    return np.roll(self.speeds, (step // rotate_every) % len(self.speeds))

  def group_link(self, devices) -> tuple[float, float]:
    """(latency, bandwidth) of the slowest link among `devices` (0, inf for one device)."""
    d = np.asarray(devices).reshape(-1)
    if d.size < 2:
      return 0.0, math.inf
    off = ~np.eye(d.size, dtype=bool)
    return (float(self.latency_s[np.ix_(d, d)][off].max()),
            float(self.bandwidth[np.ix_(d, d)][off].min()))


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineEmulator:
  """The emulated time of a pipelined step (`core.pipeline`) on unequal devices and links.

  Per data-parallel pipeline d and stage p, one layer's forward of one microbatch takes the
  slowest tensor device's time, sum_k unit_ms[k] x (the width it executes) / speed, plus two
  tensor all-reduces of the microbatch's activations over the group's slowest link
  (`schedule.allreduce_s`); the first stage also runs the embedding and the last the head,
  whole, on every device (`edge_ms`, on the group's slowest device); `schedule.stage_seconds`
  makes the stage's forward and backward of it, and each boundary transfer is `schedule.send_s`
  over the slowest of its links (tensor position t of stage p to position t of stage p + 1).
  The pipeline takes `schedule.step_time` of its tick table. After the last tick the step
  all-reduces the replicated parameters' gradients (embedding, final norm, head) over `pipe`,
  then every gradient over `data`, each a ring over the slowest link it crosses (the slowest
  ring of each). The step lasts as long as the slowest pipeline plus those all-reduces.

  Attributes:
    devices: speeds and links by device id.
    grid: int [D, P, T] the device id at each mesh position.
    unit_ms: {kind: forward milliseconds of one unit in one layer for one microbatch at speed 1}.
    activation_bytes: bytes of one microbatch's activations at a layer boundary.
    stack_bytes: bytes of one device's block parameters (its padded local shard).
    shared_bytes: bytes of the replicated parameters.
    schedule: the tick tables' schedule.
    edge_ms: [P] forward milliseconds at speed 1 of each stage's unsplit work outside the blocks
      for one microbatch (the embedding on the first, the head on the last); () = none.
  """

  devices: Devices
  grid: np.ndarray
  unit_ms: dict
  activation_bytes: float
  stack_bytes: float
  shared_bytes: float
  schedule: str
  edge_ms: tuple = ()

  def with_speeds(self, speeds) -> "PipelineEmulator":
    """This emulator on devices of other speeds [N] (the same links)."""
    return dataclasses.replace(self, devices=self.devices.with_speeds(speeds))

  def layout_step(self, layout, microbatches: Sequence[int]) -> dict:
    """`step` of what a `core.pipeline.PipeLayout` executes: each stage's layers, and each
    tensor device the compiled width its units run at (`plan.executed_widths`)."""
    executed = [{k: w[:, 0] for k, w in plan_lib.executed_widths(u, 1).items()}
                for u in layout.units]
    return self.step(layout.stage_layers, executed, microbatches)

  def step(self, layers, executed: Sequence[dict], microbatches: Sequence[int]) -> dict:
    """The emulated seconds of a step and their parts.

    Args:
      layers: [P] layers each stage runs.
      executed: per stage, {kind: [T] the width each tensor device executes}.
      microbatches: [D] microbatches of each pipeline.

    Returns:
      {"step_s", "pipeline_s": [D], "bubble": the slowest pipeline's idle share,
       "transfer_s": its boundary transfers, "allreduce_s": the gradient all-reduces}.
    """
    v, dev = self.devices.speeds, self.devices
    r_, s_, t_ = self.grid.shape
    act = self.activation_bytes
    pipelines, bubbles, transfers = [], [], []
    edge = np.asarray(self.edge_ms, np.float64) * 1e-3 if self.edge_ms else np.zeros(s_)
    for d in range(r_):
      c, a, e = np.zeros(s_), np.zeros(s_), np.zeros(s_)
      send = np.zeros(max(s_ - 1, 0))
      for p in range(s_):
        ids = self.grid[d, p]
        c[p] = max(sum(self.unit_ms[k] * float(w[t]) for k, w in executed[p].items()) / v[i]
                   for t, i in enumerate(ids)) * 1e-3
        e[p] = edge[p] / min(v[i] for i in ids)
        a[p] = schedule_lib.allreduce_s(act, t_, *dev.group_link(ids))
        if p < s_ - 1:
          send[p] = max(schedule_lib.send_s(act, dev.latency_s[i, j], dev.bandwidth[i, j])
                        for i, j in zip(ids, self.grid[d, p + 1]))
      tab = schedule_lib.table(self.schedule, s_, int(microbatches[d]))
      f, b = schedule_lib.stage_seconds(layers, c, a, e)
      total = schedule_lib.step_time(tab, f, b, send, send)
      pipelines.append(total)
      bubbles.append(schedule_lib.bubble(tab, f, b))
      transfers.append(total - schedule_lib.step_time(tab, f, b, 0 * send, 0 * send))
    ring = lambda nbytes, ids: schedule_lib.allreduce_s(nbytes, len(ids), *dev.group_link(ids))
    over_pipe = max(ring(self.shared_bytes, self.grid[d, :, t])
                    for d in range(r_) for t in range(t_))
    over_data = max(ring(self.shared_bytes + self.stack_bytes, self.grid[:, p, t])
                    for p in range(s_) for t in range(t_))
    allreduce = over_pipe + over_data
    worst = int(np.argmax(pipelines))
    return {"step_s": float(max(pipelines) + allreduce),
            "pipeline_s": [float(x) for x in pipelines], "bubble": float(bubbles[worst]),
            "transfer_s": float(transfers[worst]), "allreduce_s": float(allreduce)}
