"""Per-device speed, measured while training: a probe, sharing between processes, change detection.

Where the speeds come from:
  * real runs (one or more processes): every process measures its own devices between steps and
    the numbers are shared with `gather_times`, so every process sees the same numbers and makes
    the same decisions (the controller's inputs must be identical on every process of an SPMD
    program). On Linux CPUs `SchedShare` reads the share of CPU time the process got while it
    was ready to run from the kernel's scheduler statistics (exact, costs no compute); on GPUs,
    TPUs and hosts without those statistics `probe.Probe` times the model's MLP block on every
    device at once (no collectives);
  * emulated runs (one process, fake devices): the emulated slowdown factor of each device stands
    in for its probe time (`hetero.slowdown` is exactly "time of the same work").

`SpeedTracker` turns times into relative speeds (fastest device = 1.0) and tells a lasting change
from a burst: a new level must persist for `confirm` consecutive samples before it becomes the
current *regime*; a shorter excursion is ignored. It remembers how long past regimes lasted, which
the controller uses to guess how long the current one will last.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np

from semijax.core import mesh as mesh_lib


class SchedShare:
  """The share of CPU time this process got while it was ready to run (Linux scheduler stats).

  For each of this process's threads the kernel counts nanoseconds on a CPU and nanoseconds
  runnable but waiting for one (/proc/self/task/*/schedstat). Over the window since the last
  call, share = on / (on + waiting), summed over the threads' changes: about 1.0 on a core of
  its own, 0.5 beside one CPU-bound competitor. Time blocked in a collective counts as neither,
  and so does the window's time of a thread that ended in it (its counters are gone; subtracting
  its earlier totals would make the window's sums wrong, even negative). `measure` reports
  1 / share as the relative time of a fixed amount of work on each local device (a process's
  devices share its cores), so it plugs in where `Probe` does, without computing anything.
  """

  PATH = "/proc/self/task"

  def __init__(self, devices=None):
    self.devices = list(devices if devices is not None else jax.local_devices())
    self._last = self._read()

  @classmethod
  def available(cls) -> bool:
    try:
      return os.path.isdir(cls.PATH) and sum(on for on, _ in cls._read_once().values()) > 0
    except (OSError, ValueError):
      return False

  @classmethod
  def _read_once(cls) -> dict[str, tuple[int, int]]:
    """{thread id: (ns on a CPU, ns runnable but waiting)} of the live threads."""
    out = {}
    for task in os.listdir(cls.PATH):
      try:
        with open(os.path.join(cls.PATH, task, "schedstat")) as f:
          a, b, _ = f.read().split()
      except (OSError, ValueError):     # a thread that just ended
        continue
      out[task] = (int(a), int(b))
    return out

  def _read(self) -> dict[str, tuple[int, int]]:
    return self._read_once()

  def warm_up(self) -> None:
    self._last = self._read()

  def measure(self) -> dict[int, float]:
    """{device id: 1 / share} over the window since the previous call."""
    now = self._read()
    on = wait = 0
    for task, (a, b) in now.items():      # a thread started in the window counts from zero
      a0, b0 = self._last.get(task, (0, 0))
      on, wait = on + a - a0, wait + b - b0
    self._last = now
    share = on / (on + wait) if on + wait > 0 else 1.0
    return {d.id: 1.0 / max(share, 1e-3) for d in self.devices}


def gather_times(local: dict[int, float], extra: float = 0.0) -> tuple[dict[int, float], float]:
  """Shares per-device times (and one number per process) with every process.

  Args:
    local: {device id: seconds} measured by this process.
    extra: a per-process scalar to share (e.g. this process's last step time).

  Returns:
    ({device id: seconds} over all processes, max of `extra` over processes), identical on
    every process.
  """
  if jax.process_count() == 1:
    return dict(local), float(extra)
  from jax.experimental import multihost_utils
  ids = sorted(local)
  row = np.array([[i, local[i]] for i in ids] + [[-1.0, extra]], np.float64)
  rows = np.asarray(multihost_utils.process_allgather(row))   # [P, len(ids) + 1, 2]
  times = {int(i): float(t) for i, t in rows[:, :-1].reshape(-1, 2)}
  return times, float(rows[:, -1, 1].max())


def tensor_times(mesh: jax.sharding.Mesh, times: dict[int, float]) -> np.ndarray:
  """float [N]: for each tensor position, the slowest time over its data replicas."""
  devices = np.asarray(mesh.devices)
  axis = mesh.axis_names.index(mesh_lib.TENSOR)
  devices = np.moveaxis(devices, axis, -1).reshape(-1, devices.shape[axis])
  return np.array([max(times[int(d.id)] for d in devices[:, t]) for t in range(devices.shape[1])])


@dataclasses.dataclass
class Regime:
  """A period of stable per-device speeds."""

  speeds: np.ndarray      # float [N], relative (fastest = 1)
  start_s: float          # when it began (clock seconds)


# The shortest remaining duration a regime is expected to have: a second, so that a regime just
# confirmed still amortizes a migration over a few steps rather than over none.
MIN_EXPECTED_S = 1.0


class SpeedTracker:
  """Relative per-device speeds with smoothing and change detection (see module doc).

  A device *deviates* when its sample differs from the regime's level by more than `threshold`;
  a device that deviates in `confirm` consecutive samples confirms a new regime (its speed the
  last of those samples: the first one often straddles the change, half in the old regime, and
  their mean made `semi` move to a split in between and again a few steps later; devices that
  did not deviate keep theirs). Deviations are counted per
  device, so bursts that alternate between devices never add up to a regime.

  Args:
    num_devices: N, tensor devices.
    alpha: EWMA weight of a new sample inside a regime (in log space).
    threshold: a device whose sample differs from the regime's level by more than this factor
      (e.g. 0.2 = 20%) is deviating.
    confirm: consecutive deviating samples of one device that make a new regime (shorter = a
      burst, ignored).
    min_expected_s: the shortest remaining duration `expected_remaining_s` returns.
  """

  def __init__(self, num_devices: int, *, alpha: float = 0.3, threshold: float = 0.2,
               confirm: int = 3, min_expected_s: float = MIN_EXPECTED_S):
    if not 0 < alpha <= 1:
      raise ValueError(f"balance.speed_alpha: must be in (0, 1], got {alpha}")
    if not threshold > 0:
      raise ValueError(f"balance.change_threshold: must be positive, got {threshold}")
    if confirm < 1:
      raise ValueError(f"balance.confirm: must be >= 1, got {confirm}")
    self.num_devices, self.alpha, self.confirm = num_devices, alpha, confirm
    self.log_threshold = math.log1p(threshold)
    self.min_expected_s = min_expected_s
    self.regime: Regime | None = None
    self.history: list[tuple[float, np.ndarray]] = []   # (duration s, speeds) of past regimes
    self._streak = np.zeros(num_devices, np.int64)      # consecutive deviating samples
    self._since = np.zeros(num_devices)                 # when each device's streak began
    self.samples = 0
    self.provisional = False    # the regime is a warm-up sample's, replaced by the next sample

  @property
  def speeds(self) -> np.ndarray:
    """float [N]: the current regime's smoothed relative speeds (ones before any sample)."""
    return np.ones(self.num_devices) if self.regime is None else self.regime.speeds.copy()

  def update(self, times, now: float, provisional: bool = False) -> bool:
    """Adds one sample: `times` [N] of the same work on each device, at clock time `now`.

    A `provisional` sample (taken in warm-up) sets a regime that the next sample replaces
    outright, as the first sample of a run does.

    Returns True when the sample confirmed a new regime.
    """
    times = np.asarray(times, np.float64)
    if times.shape != (self.num_devices,) or not np.all(np.isfinite(times) & (times > 0)):
      raise ValueError(f"speed sample: need {self.num_devices} positive times, got {times}")
    self.samples += 1
    raw = np.log(times.min() / times)
    if self.regime is None or self.provisional:
      self.regime, self.provisional = Regime(np.exp(raw), now), provisional
      return True
    level = np.log(self.regime.speeds)
    deviating = np.abs(raw - level) > self.log_threshold
    self._since = np.where(deviating & (self._streak == 0), now, self._since)
    self._streak = np.where(deviating, self._streak + 1, 0)
    confirmed = self._streak >= self.confirm
    if confirmed.any():
      start = float(self._since[confirmed].min())
      self.history.append((start - self.regime.start_s, self.regime.speeds))
      speeds = np.exp(np.where(confirmed, raw, level))
      self.regime = Regime(speeds / speeds.max(), start)
      self._streak[:] = 0
      return True
    if deviating.any():          # maybe the start of a change: do not blend it into the level
      return False
    mixed = np.exp((1 - self.alpha) * level + self.alpha * raw)
    self.regime.speeds = mixed / mixed.max()
    return False

  def elapsed_s(self, now: float) -> float:
    return 0.0 if self.regime is None else now - self.regime.start_s

  def expected_remaining_s(self, now: float) -> float:
    """How much longer the current regime is expected to last.

    While the current regime is younger than the typical past one (the median of the last four
    durations), what is left of that typical duration; with no past regime, or once this one
    has outlasted the typical one (so the past says little about it: e.g. a short regime seen
    at start-up before a lasting slowdown), as long as it has lasted so far (a change that has
    persisted for t tends to persist for about t more). Never less than `min_expected_s`.
    """
    elapsed = self.elapsed_s(now)
    guess = elapsed
    if self.history:
      typical = float(np.median([d for d, _ in self.history[-4:]]))
      if elapsed < typical:
        guess = typical - elapsed
    return max(guess, self.min_expected_s)
