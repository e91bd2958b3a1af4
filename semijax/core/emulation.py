"""Emulated heterogeneity: slow devices as a delay proportional to the work they really do.

On one host the fake CPU devices share the cores, so extra *compute* on one device slows all of
them. A *sleep* costs no CPU, so sleeping, per block, for the extra time its slowest device would
take makes the step wait like a real straggler in a TP group (DESIGN.md s4): every block ends in
an all-reduce, so a block takes as long as its slowest device. A device with slowdown s that
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

import numpy as np

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
  """

  slowdown: tuple[float, ...] | None = None
  device_gflops: float = 2.0
  rotate_every: int = 0

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


@dataclasses.dataclass(frozen=True)
class Emulator:
  """The emulated slowdown of a run (see module doc).

  Attributes:
    hetero: the slowdown profile over time.
    unit_ms: {kind: emulated milliseconds per unit of executed width at slowdown 1} (`unit_ms`).
  """

  hetero: Hetero
  unit_ms: dict

  def delay_s(self, step: int, executed: dict) -> float:
    """Seconds the slowest devices add to 0-based `step`, which executes `executed`
    ({kind: [N, L]} widths, `core.plan.executed_widths`): the sum over blocks of the largest
    per-device time."""
    slowdown = np.asarray(self.hetero.slowdown_at(step), np.float64)[:, None]
    ms = sum(float((self.unit_ms[k] * np.asarray(e) * slowdown).max(axis=0).sum())
             for k, e in executed.items())
    return ms / 1e3

  @staticmethod
  def sleep(seconds: float) -> None:
    if seconds > 0:
      time.sleep(seconds)

