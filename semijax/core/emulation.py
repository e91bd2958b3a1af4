"""Emulated heterogeneity: slow devices as a delay proportional to the work they really do.

On one host the fake CPU devices share the cores, so extra *compute* on one device slows all of
them. A *sleep* costs no CPU, so a per-device sleep of (work the device executes) / (its speed)
makes the step wait for the slowest device, like a real straggler in a TP group (DESIGN.md s4).

The sleep goes right before each block's all-reduce, so every TP synchronization waits for that
block's slowest device. It runs in the forward pass only and is sized for forward + backward.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

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


def flops_per_unit(*, d_model: int, head_dim: int, seq_len: int, causal: bool) -> dict:
  """Forward FLOPs per token of one unit of each kind.

  mlp: one column of the up-projection and one row of the down-projection (2 * 2 * d_model).
  heads: head_dim columns of Q, K, V, head_dim rows of the output projection, and the score and
  value products over the sequence (halved when causal).
  """
  attn = 2 * 2 * seq_len * head_dim * (0.5 if causal else 1.0)
  return {"mlp": 4.0 * d_model, "heads": 8.0 * d_model * head_dim + attn}


def unit_ms(flops: dict, tokens_per_device: int, device_gflops: float) -> dict:
  """Emulated milliseconds (forward + backward) per unit of each kind at speed 1."""
  if device_gflops <= 0:
    raise ValueError(f"hetero.device_gflops: must be positive, got {device_gflops}")
  return {k: FWD_BWD_FACTOR * f * tokens_per_device / (device_gflops * 1e9) * 1e3
          for k, f in flops.items()}
