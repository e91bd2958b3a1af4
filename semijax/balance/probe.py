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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

MAX_ROWS = 8192     # a model-shaped probe's rows at most (a long-sequence, large-batch model)


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


class Probe:
  """Times `repeats` passes of `shape` on each of `devices`, all at once (see module doc).

  Args:
    shape: a `ProbeShape`.
    repeats: passes per probe (chained, in one program).
    devices: the devices to time (default: this process's devices).
  """

  def __init__(self, shape: ProbeShape, repeats: int = 1, devices=None):
    if min(shape.rows, shape.d_model, shape.width) < 1 or repeats < 1:
      raise ValueError(f"balance.probe_size / probe_repeats must be >= 1, got {shape}, "
                       f"{repeats}")
    self.shape, self.repeats = shape, repeats
    self.devices = list(devices if devices is not None else jax.local_devices())
    self.flops = shape.flops * repeats
    dtype = jnp.dtype(shape.dtype)

    def chain(x, w_in, w_out):
      def one(_, h):
        return jnp.tanh(jnp.tanh(h @ w_in) @ w_out)
      return jax.lax.fori_loop(0, repeats, one, x)

    self._fn = jax.jit(chain)
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) / np.sqrt(s[0])
              for s in ((shape.rows, shape.d_model), (shape.d_model, shape.width),
                        (shape.width, shape.d_model))]
    self._inputs = [tuple(jax.device_put(a.astype(dtype), d) for a in arrays)
                    for d in self.devices]
    self._pool = None

  def warm_up(self) -> None:
    """Compiles the probe for every device (outside the hot path)."""
    for args in self._inputs:
      self._fn(*args).block_until_ready()

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
