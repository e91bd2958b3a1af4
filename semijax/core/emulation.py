"""Emulated heterogeneity: slow devices as a delay proportional to the work they really do.

On one host the fake CPU devices share the cores, so extra *compute* on one device slows all of
them. A *sleep* costs no CPU, so a per-device sleep of (work the device executes) / (its speed)
makes the step wait for the slowest device, like a real straggler in a TP group (DESIGN.md s4).

The sleep goes right before each block's all-reduce, so every TP synchronization waits for that
block's slowest device. It runs in the forward pass only and is sized for forward + backward.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from semijax.errors import ConfigError

# Backward costs about twice the forward: a forward-only sleep is charged for all three.
FWD_BWD_FACTOR = 3.0


def _sleep(ms):
  ms = float(np.asarray(ms).reshape(()))
  if ms > 0:
    time.sleep(ms / 1e3)
  return np.zeros((), np.float32)


def straggle(x: jax.Array, delay_ms: jax.Array) -> jax.Array:
  """Returns x after this device slept `delay_ms` (call inside shard_map; x is unchanged).

  The sleep's zero output is added to x, so the following collective waits for it.
  """
  z = io_callback(_sleep, jax.ShapeDtypeStruct((), jnp.float32), delay_ms)
  return x + jax.lax.stop_gradient(z).astype(x.dtype)


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

