"""`BalanceSettings`: the typed form of `config.balance`, validated once.

Every knob of the balancing layer is here, with its meaning; `validate` raises a ConfigError that
names the field, what is wrong and what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from semijax.errors import ConfigError

MEASURES = ("auto", "sched", "probe", "emulated")


@dataclasses.dataclass(frozen=True)
class BalanceSettings:
  """What decides, while training, who computes how much (`config.balance`).

  Policy and buckets:
    policy: a name in `balance.policies.REGISTRY` (even, static, resize, migrate, offload, semi).
    capacity_factor: the dynamic policies' big bucket holds factor x the even share per device.
    num_widths: compute widths compiled in that bucket (0 = `layout.num_widths`).
    drain: whether a migrating policy may move every unit off a device (a drained device,
      e.g. one failing slowly, computes nothing; the buckets also compile the width 0).
  Measuring speeds:
    measure: "emulated" (the `hetero.slowdown` profile), "sched" (Linux scheduler stats), "probe"
      (timing the model's MLP block on every device at once, `probe.Probe`) or "auto"
      (emulated if a profile is set, else sched on CPU devices, else probe).
    probe_every: steps between speed samples (and decisions) of real runs.
    probe_size: 0 = the probe runs the model's MLP block on one device's tokens of a step;
      else [size, size] matmuls.
    probe_repeats: passes of the probe in a row; 0 = as many as fit in `probe_budget`.
    probe_budget: with `probe_repeats` 0, the probe's share of the time between two samples
      (sized once, from the first sample's step time and pass time).
    probe_window: the probe's speeds are the median of its last this many samples (a short
      probe on a time-shared device reads bimodally; 1 = each sample alone).
    speed_alpha: weight of a new sample in a regime's smoothed speeds (log space).
    change_threshold: a device off its regime's speed by this factor is deviating ...
    confirm: ... and a deviation that lasts this many samples on that device is a new regime.
  Deciding:
    hysteresis: a change must be predicted this much faster ...
    patience: ... in this many consecutive decisions;
    min_dwell_steps: steps between migrations at least.
    slow_threshold: relative speed below which a device counts as slow.
    resize_budget: semi: the largest share of a device's units it may skip.
    resize_keep: the resize policy's keep ratio of a slow device (the authors' 0.5).
    resize_penalty: a price on resizing, as a share of its step time, on top of the learning
      a resized step skips (the controller divides its time by the share of work it keeps).
    resize_horizon_steps: semi resizes while migrating does not pay yet, and also (even when
      it does) slowdowns expected to end within this many steps; 0 (the default): only the
      first, since a new regime's expected length is its age, which reads short at first.
    skip_budget: semi's running budget of skipped work: the units x steps it skipped stay
      below this share of all units x steps run so far (0 = never resize).
    keep_grid: semi picks keep ratios on a grid of 1/keep_grid.
  The cost model:
    fixed_fraction: prior share of a step that no split changes (until the fit knows better).
    repeat_share: prior of the work every device repeats at its own speed, in shares of the
      model's block work (`cost.CostModel`'s `repeat`; until the fit knows better).
    fit_repeat: whether the cost fit may replace `repeat_share` online. Hold it (False) where a
      calibration timed it: across speed regimes the fit also explains time that the model has
      no term for (collectives that slow down with contention), and its value wanders.
    cost_alpha: weight of a new measurement in the per-load estimate, before the fit takes over.
    cost_memory: how many recent samples the cost fit remembers (older ones fade by
      1 - 1/cost_memory per sample).
  """

  policy: str = "static"
  capacity_factor: float = 2.0
  num_widths: int = 0
  drain: bool = True
  measure: str = "auto"
  probe_every: int = 4
  probe_size: int = 0
  probe_repeats: int = 0
  probe_budget: float = 0.03
  probe_window: int = 3
  speed_alpha: float = 0.3
  change_threshold: float = 0.2
  confirm: int = 2
  hysteresis: float = 0.05
  patience: int = 2
  min_dwell_steps: int = 5
  slow_threshold: float = 0.85
  resize_budget: float = 0.5
  resize_keep: float = 0.5
  resize_penalty: float = 0.05
  resize_horizon_steps: float = 0
  skip_budget: float = 0.02
  keep_grid: int = 8
  fixed_fraction: float = 0.1
  repeat_share: float = 0.0
  fit_repeat: bool = True
  cost_alpha: float = 0.3
  cost_memory: float = 10.0

  def validate(self, policies=None) -> "BalanceSettings":
    """Raises ConfigError naming the first bad field; `policies`: the known policy names."""
    f = "config.balance"
    if policies is not None and self.policy not in policies:
      raise ConfigError(f"{f}.policy: {self.policy!r} is not one of {list(policies)}")
    if self.measure not in MEASURES:
      raise ConfigError(f"{f}.measure: {self.measure!r} is not one of {list(MEASURES)}")
    for name, lo, hi, closed in (
        ("hysteresis", 0, 1, False), ("slow_threshold", 0, 1, False),
        ("resize_budget", 0, 1, False), ("resize_penalty", 0, 1, False),
        ("skip_budget", 0, 1, False), ("probe_budget", 0, 1, False),
        ("fixed_fraction", 0, 1, False), ("resize_keep", 0, 1, True),
        ("repeat_share", 0, 1, False),
        ("speed_alpha", 0, 1, True), ("cost_alpha", 0, 1, True),
        ("change_threshold", 0, 1, True)):
      v = getattr(self, name)
      lo_ok = v > lo if closed else v >= lo
      hi_ok = v <= hi if closed else v < hi
      if not _is_number(v) or not (lo_ok and hi_ok):
        interval = f"({lo}, {hi}]" if closed else f"[{lo}, {hi})"
        raise ConfigError(f"{f}.{name}: must be in {interval}, got {v!r}")
    for name in ("fit_repeat", "drain"):
      if not isinstance(getattr(self, name), bool):
        raise ConfigError(f"{f}.{name}: must be True or False, got {getattr(self, name)!r}")
    for name, lo in (("capacity_factor", 1.0), ("cost_memory", 1.0), ("resize_horizon_steps", 0)):
      v = getattr(self, name)
      if not _is_number(v) or not v >= lo:
        raise ConfigError(f"{f}.{name}: must be a number >= {lo}, got {v!r}")
    for name, lo in (("probe_every", 1), ("probe_size", 0), ("probe_repeats", 0),
                     ("probe_window", 1), ("confirm", 1),
                     ("patience", 1), ("keep_grid", 1), ("min_dwell_steps", 0),
                     ("num_widths", 0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ConfigError(f"{f}.{name}: must be an integer >= {lo}, got {v!r}")
    return self


def _is_number(v) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
