"""Bytes per device: what each device holds, and the peak of an operation made of programs.

`held_bytes()` sums, per device, the shards of every live JAX array. `PeakMeter` records the peak
of an operation: library code calls `observe(compiled)` right before it runs a compiled program,
and an active meter adds that program's own per-device output and temporary bytes (XLA's memory
analysis of the partitioned, per-device program) to what the devices hold at that moment (its
arguments are live arrays already). Outside a meter, `observe` does nothing.

This is how the tests show that no device ever holds the whole state: a bucket switch, a
checkpoint and a priority refresh stay within a bound of what a device holds in steady training.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax
import numpy as np

_ACTIVE: list = []


def held_bytes() -> np.ndarray:
  """int64 [number of devices]: bytes of live buffers on each device (`jax.devices()`).

  Every buffer counts once: a global array and the single-device views of its shards (which
  `jax.live_arrays()` lists too, once anything touched `shard.data`) share their buffers.
  """
  index = {d.id: i for i, d in enumerate(jax.devices())}
  out = np.zeros(len(index), np.int64)
  seen = set()
  for x in jax.live_arrays():
    if x.is_deleted():
      continue
    for shard in x.addressable_shards:
      key = (shard.device.id, shard.data.unsafe_buffer_pointer())
      if key not in seen:
        seen.add(key)
        out[index[shard.device.id]] += shard.data.nbytes
  return out


class PeakMeter:
  """The largest bytes any device held during the `with` block (see module doc)."""

  def __init__(self):
    self.peak = 0
    self.programs = 0

  def observe(self, compiled) -> None:
    stats = compiled.memory_analysis()
    extra = 0 if stats is None else (stats.output_size_in_bytes + stats.temp_size_in_bytes
                                      - stats.alias_size_in_bytes)
    self.peak = max(self.peak, int(held_bytes().max()) + extra)
    self.programs += 1

  def sample(self) -> None:
    """Records what the devices hold now (e.g. after the last program of the operation)."""
    self.peak = max(self.peak, int(held_bytes().max()))


@contextlib.contextmanager
def peak() -> Iterator[PeakMeter]:
  """Measures the peak bytes per device of the programs run inside the block."""
  meter = PeakMeter()
  meter.sample()
  _ACTIVE.append(meter)
  try:
    yield meter
  finally:
    _ACTIVE.remove(meter)
    meter.sample()


def observe(compiled) -> None:
  """Called by library code before it runs `compiled` (a `jax.stages.Compiled`)."""
  for meter in _ACTIVE:
    meter.observe(compiled)
