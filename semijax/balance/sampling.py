"""Speed sampling in a training loop: when to measure, from what, and the shared clock.

Every `probe_every` steps (every step when the slowdown is emulated) `SpeedSampler.after_step`
takes one sample: each process measures its devices (`speed.SchedShare` or `probe.Probe`), the
numbers and the mean step time since the last sample are shared between processes
(`KeyValueGather`), and the tracker (`speed.SpeedTracker`) updates the regime. The shared
clock (the sum of shared mean step times) and the smoothed step time are identical on every
process, so decisions taken from a sample are too.

The probe is sized and filtered for time-shared devices. With `balance.probe_repeats` 0 the
first sample sizes it: as many passes as fit in `probe_budget` of the time between two samples,
from every device's pass time and the slowest process's step time, shared so that every process
runs the same probe. Its speeds are then the median of its last `probe_window` samples: a probe
shorter than a scheduler slice sometimes runs whole on a shared core and reads as fast, and one
such sample alone would otherwise start a new regime.

With a few processes, sharing goes through the job's key-value store (`jax.distributed`'s
coordinator), not a device collective: a few hundred bytes per process, no XLA program and no
device synchronization (measured here with 2 processes: 0.6 ms a sample, against 4-7 ms for
`multihost_utils.process_allgather`), so that measuring costs almost nothing when nobody is
slow. Every process reads every record from the coordinator, P^2 reads a sample, so beyond
`KV_MAX_PROCESSES` processes the all-gather (`speed.gather_times`, which scales) is used.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import time

import jax
import numpy as np
from jax._src import distributed as jax_distributed   # the job's key-value store client

from semijax.balance import probe as probe_lib
from semijax.balance import settings as settings_lib
from semijax.balance import speed as speed_lib
from semijax.core import emulation
from semijax.core import mesh as mesh_lib

# Weight of a new sample's mean step time in the smoothed step time that converts the expected
# remaining seconds of a regime into steps: 0.3 follows a change within about three samples
# while one noisy sample moves it by less than a third.
STEP_TIME_ALPHA = 0.3


@dataclasses.dataclass(frozen=True)
class Sample:
  """One shared speed sample.

  Attributes:
    times: float [N], relative time of the same work on each tensor device (slowest = largest;
      the probe's: the median of its last `probe_window` samples).
    mean_s: mean step seconds since the previous sample (the slowest process's).
    clock_s: the shared clock after those steps.
    probe_s: seconds this sample cost.
    new_regime: whether the tracker confirmed a new regime with it.
  """

  times: np.ndarray
  mean_s: float
  clock_s: float
  probe_s: float
  new_regime: bool
  raw: np.ndarray | None = None

  @property
  def raw_speeds(self) -> np.ndarray:
    """float [N]: this sample's own relative speeds, before the probe's window (fastest = 1)."""
    raw = self.times if self.raw is None else self.raw
    return raw.min() / raw

  @property
  def speeds(self) -> np.ndarray:
    """float [N]: relative speeds of this sample alone (fastest = 1)."""
    return self.times.min() / self.times


_samplers = itertools.count()   # one key prefix per sampler (created in the same order everywhere)
KV_MAX_PROCESSES = 16           # more processes share samples with the all-gather
_WAIT_MS = 600_000              # the longest a process waits for the others' sample
_KEEP = 2                       # samples whose keys a process keeps in the store


class KeyValueGather:
  """Shares per-device times (and one number per process) through the key-value store.

  Call it with the same arguments as `speed.gather_times`, in the same order on every process;
  each call posts this process's record under a new key and reads every other's (waiting for
  it), then deletes this process's record of `_KEEP` calls ago (everybody has read it by then).
  With one process, more than `KV_MAX_PROCESSES`, or without `jax.distributed`, it is
  `speed.gather_times`.
  """

  def __init__(self):
    self.client = None
    if 1 < jax.process_count() <= KV_MAX_PROCESSES:
      self.client = jax_distributed.global_state.client
    self.prefix = f"semijax/speed/{next(_samplers)}/"
    self.calls = 0

  def __call__(self, local: dict[int, float], extra: float = 0.0):
    """({device id: seconds} over all processes, max of `extra` over processes)."""
    if self.client is None:
      return speed_lib.gather_times(local, extra)
    i, me = self.calls, jax.process_index()
    self.calls += 1
    self.client.key_value_set(f"{self.prefix}{i}/{me}",
                              json.dumps([extra, [[int(k), float(v)] for k, v in local.items()]]))
    times, most = {}, -np.inf
    for p in range(jax.process_count()):
      e, rows = json.loads(self.client.blocking_key_value_get(f"{self.prefix}{i}/{p}", _WAIT_MS))
      times.update({int(k): float(v) for k, v in rows})
      most = max(most, float(e))
    if i >= _KEEP:
      self.client.key_value_delete(f"{self.prefix}{i - _KEEP}/{me}")
    return times, most


def resolve_measure(measure: str, hetero: emulation.Hetero, backend: str | None = None) -> str:
  """The speed source `measure` ("auto" resolved): emulated where a slowdown is emulated; sched
  on the CPU backend where the host has it (the CPU share of a process's threads is its
  devices' speed there, and nowhere else); else probe. `backend`: default JAX's."""
  if measure != "auto":
    return measure
  if hetero.slowdown is not None:
    return "emulated"
  backend = jax.default_backend() if backend is None else backend
  return "sched" if backend == "cpu" and speed_lib.SchedShare.available() else "probe"


class SpeedSampler:
  """Takes the shared speed samples of a run (see module doc).

  Args:
    settings: `BalanceSettings` (measure, probe_every, probe sizes, tracker knobs).
    hetero: the emulated slowdown (the speed source when measuring "emulated").
    mesh: the run's mesh (which device is which tensor position).
    block: the model's `probe.ProbeShape` (`ProbeShape.of_block`), which the probe runs unless
      `probe_size` asks for a square one; None: only a square probe can run.
  """

  def __init__(self, settings: settings_lib.BalanceSettings, hetero: emulation.Hetero, mesh,
               block: probe_lib.ProbeShape | None = None):
    self.hetero, self.mesh = hetero, mesh
    self.measure = resolve_measure(settings.measure, hetero)
    self.every = 1 if self.measure == "emulated" else settings.probe_every
    self.probe = None
    self._budget = None      # the probe's share of the time between samples, until it is sized
    window = 1
    if self.measure == "probe":
      self.probe = probe_lib.Probe(probe_lib.ProbeShape.configured(settings.probe_size, block),
                                   max(1, settings.probe_repeats))
      self._budget = settings.probe_budget if settings.probe_repeats == 0 else None
      window = settings.probe_window
    elif self.measure == "sched":
      self.probe = speed_lib.SchedShare()
    self._recent = collections.deque(maxlen=window)   # relative times [N] of the last samples
    num_devices = mesh.shape[mesh_lib.TENSOR]
    self.tracker = speed_lib.SpeedTracker(num_devices, alpha=settings.speed_alpha,
                                          threshold=settings.change_threshold,
                                          confirm=settings.confirm)
    self.gather = KeyValueGather() if self.probe is not None else None
    self.clock_s = 0.0
    self.step_s = None          # the smoothed step time (STEP_TIME_ALPHA)
    self.samples = 0
    self.probe_s = 0.0
    self._pending: list[float] = []

  @property
  def passes(self) -> int | None:
    """The probe's passes once sized; None for another source or before the first sample."""
    if not isinstance(self.probe, probe_lib.Probe) or self._budget is not None:
      return None
    return self.probe.repeats

  def describe(self) -> str:
    """The speed source in words, for the console (e.g. "probe, 3 passes, every 4 steps")."""
    every = "every step" if self.every == 1 else f"every {self.every} steps"
    if not isinstance(self.probe, probe_lib.Probe):
      return f"{self.measure}, {every}"
    n = self.passes
    passes = ("passes sized at the first sample" if n is None
              else f"{n} pass{'es' if n > 1 else ''}")
    return f"probe, {passes}, {every}"

  def close(self) -> None:
    """Ends the probe's waiting threads, if it has any."""
    if isinstance(self.probe, probe_lib.Probe):
      self.probe.close()

  def warm_up(self) -> None:
    """Compiles the probe (outside the hot path)."""
    if self.probe is not None:
      self.probe.warm_up()

  def start(self) -> None:
    """Ends warm-up: a barrier sample, so the first real one measures training steps only."""
    if self.probe is not None:
      self.gather(self.probe.measure(), 0.0)

  def due(self, step: int) -> bool:
    """Whether a sample is taken after 0-based `step`."""
    return step % self.every == 0

  def after_step(self, step: int, step_s: float) -> Sample | None:
    """Takes the measured seconds of 0-based `step`; returns a sample when one is due."""
    self._pending.append(step_s)
    return self._take(step) if self.due(step) else None

  def trial(self, step: int, step_s: float) -> Sample:
    """A sample of one step timed in warm-up, `step_s` seconds before 0-based `step` (the first
    to run), so that `step` already runs on a decision. It is provisional: the shared clock does
    not advance, and the first training sample starts the tracker's regime and the smoothed
    step time afresh (warm-up need not be the training's regime: e.g. a competing job may start
    with the training)."""
    self._pending = [step_s]
    return self._take(step, provisional=True)

  def _take(self, step: int, provisional: bool = False) -> Sample:
    """Measures, shares and tracks one sample over the pending steps' seconds; a `provisional`
    one (`trial`) is not counted: no probe time, no sample, no clock."""
    t0 = time.perf_counter()
    mean_s = float(np.mean(self._pending))
    if self._budget is not None:
      self._size_probe(mean_s)
    local = self.probe.measure() if self.probe is not None else {}
    every, mean_s = self._share(local, mean_s)
    if self.probe is not None:
      raw = np.asarray(speed_lib.tensor_times(self.mesh, every), np.float64)
    else:
      raw = np.asarray(self.hetero.slowdown_at(step), np.float64)
    self._recent.append(raw / raw.min())
    times = raw if self._recent.maxlen == 1 else np.median(np.stack(self._recent), axis=0)
    if provisional:            # warm-up's regime is not the training's: start the window afresh
      self._recent.clear()
    probe_s = 0.0 if provisional else time.perf_counter() - t0
    if not provisional:
      self.probe_s += probe_s
      self.samples += self.probe is not None
      self.clock_s += mean_s * len(self._pending)
    self._pending = []
    fresh = self.tracker.provisional
    new_regime = self.tracker.update(times, self.clock_s, provisional=provisional)
    self.step_s = mean_s if self.step_s is None or fresh else (
        (1 - STEP_TIME_ALPHA) * self.step_s + STEP_TIME_ALPHA * mean_s)
    return Sample(np.asarray(times, np.float64), mean_s, self.clock_s, probe_s, new_regime, raw)

  def _size_probe(self, step_s: float) -> None:
    """Sizes the auto-sized probe, once: the passes that fit `probe_budget` of the time between
    two samples (`every` steps of the slowest process's `step_s`), at the slowest device's pass
    time. Both are shared first, so that every process picks the same count."""
    every, step_s = self._share(self.probe.pass_seconds(), step_s)
    self.probe.set_repeats(probe_lib.passes_for(self._budget * self.every * step_s,
                                                max(every.values())))
    self._budget = None

  def _share(self, local: dict[int, float], extra: float):
    """({device id: seconds} of every process, the max of `extra` over processes)."""
    if self.gather is not None:
      return self.gather(local, extra)
    return speed_lib.gather_times(local, extra)

  def expected_remaining_s(self) -> float:
    return self.tracker.expected_remaining_s(self.clock_s)
