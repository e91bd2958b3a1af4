"""Model-FLOPs utilization of a training step on one device, at the compiled bucket widths.

A device that computes w of its units runs GEMMs of width w; its step does the model FLOPs of
those units (`step_flops`). MFU is those FLOPs per second over the device's peak for the step's
compute dtype (`peak_tflops`: a table of dense tensor-core peaks, TF32 for float32, which is the
precision XLA runs float32 matmuls in on those GPUs, or a given number).
"""

from __future__ import annotations

import time

import jax
import numpy as np

# Dense tensor-core peaks (TFLOP/s, datasheet, without sparsity) by compute dtype and device kind
# (a substring of `device_kind`; H100 as the SXM part). float32 matmuls run in TF32 on these GPUs
# under JAX's default matmul precision.
PEAK_TFLOPS = {
    "float32": {"H200": 494.7, "H100": 494.7, "A100": 156.0, "L40S": 183.0, "L4": 60.0,
                "A10": 62.5},
    "bfloat16": {"H200": 989.4, "H100": 989.4, "A100": 312.0, "L40S": 362.0, "L4": 121.0,
                 "A10": 125.0},
}
PEAK_TFLOPS["float16"] = PEAK_TFLOPS["bfloat16"]


def peak_tflops(device_kind: str, given: float = 0.0, dtype: str = "float32") -> float | None:
  """`given` if positive, else the table's peak for `device_kind` computing in `dtype`, else None
  (unknown)."""
  if given > 0:
    return float(given)
  table = PEAK_TFLOPS.get(dtype, {})
  return next((v for k, v in table.items() if k.lower() in device_kind.lower()), None)


def step_flops(spec, widths: dict, tokens: int, vocab_size: int) -> float:
  """Model FLOPs of one training step (forward + backward = 3 x forward) of a GPT on one device.

  Args:
    spec: the model's `core.spec.ModelSpec`.
    widths: {kind: units the device computes in every block} ("mlp", "heads").
    tokens: tokens in the device's batch.
    vocab_size: the output head's width.
  """
  per_unit = spec.flops_per_unit()
  blocks = spec.num_layers * sum(per_unit[k] * w for k, w in widths.items())
  head = 2.0 * spec.d_model * vocab_size
  return 3.0 * tokens * (blocks + head)


def median_step_s(step, state, batch, plan, steps: int):
  """(median seconds of one step over `steps` timed steps after 3 warm ones, the final state);
  `step(state, batch, plan) -> (state, metrics)` donates its state."""
  for _ in range(3):
    state, m = step(state, batch, plan)
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    state, m = step(state, batch, plan)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  return float(np.median(times)), state
