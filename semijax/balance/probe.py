"""The speed probe: the model's own MLP block, timed on every local device at once.

A probe sample runs one small jitted program on each of this process's devices: `repeats`
passes of an MLP block, [rows, d_model] @ [d_model, width] then [rows, width] @ [width,
d_model], in the run's compute dtype. By default (`balance.probe_size` 0) its shape is the
model's: `rows` the tokens of one device's share of a step, `width` the even share of the MLP
units, so a device's probe time moves with what slows its training GEMMs (clocks, a
co-tenant, memory bandwidth) in the precision it trains in; a positive `probe_size` probes
[size, size] matmuls instead.

Every device's program is dispatched before any is waited for, and a thread per device waits
for its own result, so the devices run the probe together and each time is its own device's,
from its dispatch to its completion. Timed one after another, a device's time would also hold
the host's launch latency, which on a GPU is most of a small program's time.

How many passes a sample runs is a run-time argument of the one compiled program
(`Probe.set_repeats`), so a sampler can size the probe once it knows the step time
(`passes_for`). A sample shorter than the scheduler's time slice of a shared device (a CPU
core, or a GPU time-sliced between processes) either runs whole or waits a slice: measured on a
CPU core shared with one busy process, a 2.5 ms probe read anywhere from 1.0x to 3.1x its
uncontended time (10th to 90th percentile), a 10 ms one 1.7x to 2.3x.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

MAX_ROWS = 8192     # a model-shaped probe's rows at most (a long-sequence, large-batch model)
MAX_PASSES = 64     # a sized probe's passes at most


@dataclasses.dataclass(frozen=True)
class ProbeShape:
  """One probe pass: x [rows, d_model] @ [d_model, width] @ [width, d_model], in `dtype`."""

  rows: int
  d_model: int
  width: int
  dtype: str = "float32"

  @classmethod
  def square(cls, size: int) -> "ProbeShape":
    """[size, size] @ [size, size] twice, float32."""
    return cls(size, size, size)

  @classmethod
  def of_block(cls, spec, tokens: int, tensor: int) -> "ProbeShape":
    """The MLP block of `spec` (a `core.spec.ModelSpec`) on `tokens` rows (at most MAX_ROWS),
    at the even share of its d_ff over `tensor` devices, in its compute dtype."""
    return cls(max(1, min(int(tokens), MAX_ROWS)), spec.d_model,
               max(1, spec.d_ff // max(1, tensor)), spec.precision.dtype)

  @classmethod
  def configured(cls, probe_size: int, block: "ProbeShape | None") -> "ProbeShape":
    """`balance.probe_size`'s shape: `block` (the model's, `of_block`) for 0, else square."""
    if probe_size:
      return cls.square(probe_size)
    if block is None:
      raise ValueError("balance.probe_size: 0 probes the model's block, whose shape was not "
                       "given")
    return block

  @property
  def flops(self) -> float:
    """FLOPs of one pass."""
    return 4.0 * self.rows * self.d_model * self.width


def passes_for(budget_s: float, pass_s: float) -> int:
  """The most passes of `pass_s` seconds each that fit in `budget_s` (1 to MAX_PASSES)."""
  if not pass_s > 0:
    return 1
  return int(min(MAX_PASSES, max(1, budget_s // pass_s)))


class Probe:
  """Times `repeats` passes of `shape` on each of `devices`, all at once (see module doc).

  Args:
    shape: a `ProbeShape`.
    repeats: passes per probe (chained, in one program; `set_repeats` changes it).
    devices: the devices to time (default: this process's devices).
  """

  def __init__(self, shape: ProbeShape, repeats: int = 1, devices=None):
    if min(shape.rows, shape.d_model, shape.width) < 1:
      raise ValueError(f"balance.probe_size: must be >= 1, got {shape}")
    self.shape = shape
    self.devices = list(devices if devices is not None else jax.local_devices())
    dtype = jnp.dtype(shape.dtype)

    def chain(x, w_in, w_out, passes):
      def one(_, h):
        return jnp.tanh(jnp.tanh(h @ w_in) @ w_out)
      return jax.lax.fori_loop(0, passes, one, x)

    self._fn = jax.jit(chain)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0])
              for s in ((shape.rows, shape.d_model), (shape.d_model, shape.width),
                        (shape.width, shape.d_model))]
    self._weights = [tuple(jax.device_put(a.astype(dtype), d) for a in arrays)
                     for d in self.devices]
    self._pool = None
    self.set_repeats(repeats)

  def set_repeats(self, repeats: int) -> None:
    """Makes every later probe run `repeats` passes (no recompilation: an argument)."""
    if isinstance(repeats, bool) or int(repeats) != repeats or repeats < 1:
      raise ValueError(f"balance.probe_repeats: must be an integer >= 1, got {repeats!r}")
    self.repeats = int(repeats)
    self.flops = self.shape.flops * self.repeats
    self._inputs = [(*w, jax.device_put(np.int32(self.repeats), d))
                    for w, d in zip(self._weights, self.devices)]

  def warm_up(self) -> None:
    """Compiles the probe for every device (outside the hot path)."""
    for args in self._inputs:
      self._fn(*args).block_until_ready()

  def pass_seconds(self, tries: int = 3) -> dict[int, float]:
    """{device id: seconds} of one pass on each local device, the fastest of `tries` probes
    (for sizing the probe: a try that waited for the host is not the device's speed)."""
    repeats = self.repeats
    self.set_repeats(1)
    try:
      times = [self.measure() for _ in range(tries)]
    finally:
      self.set_repeats(repeats)
    return {k: min(t[k] for t in times) for k in times[0]}

  def measure(self) -> dict[int, float]:
    """{device id: seconds} of one probe on each local device, all dispatched at once."""
    starts, outs = [], []
    for args in self._inputs:
      starts.append(time.perf_counter())
      outs.append(self._fn(*args))
    if len(outs) == 1:
      ends = [self._finish(outs[0])]
    else:
      if self._pool is None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            len(outs), thread_name_prefix="semijax-probe")
      ends = list(self._pool.map(self._finish, outs))
    return {d.id: end - start for d, start, end in zip(self.devices, starts, ends)}

  @staticmethod
  def _finish(out) -> float:
    """The time `out` is ready at (waits for it)."""
    out.block_until_ready()
    return time.perf_counter()

  def close(self) -> None:
    """Ends the waiting threads (a probe of one device has none)."""
    if self._pool is not None:
      self._pool.shutdown(wait=False)
      self._pool = None
