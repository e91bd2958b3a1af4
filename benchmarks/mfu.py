"""Model-FLOPs utilization of a training step on one device, at the compiled bucket widths.

A device that computes w of its units runs GEMMs of width w; its step does the model FLOPs of
those units (`step_flops`). MFU is those FLOPs per second over the device's peak for the step's
compute dtype (`peak_tflops`: the library's table of dense peaks, `semijax.core.flops`, or a
given number).
"""

from __future__ import annotations

import time

import jax
import numpy as np

from semijax.core import flops

PEAK_TFLOPS, peak_tflops = flops.PEAK_TFLOPS, flops.peak_tflops     # the library's table


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
