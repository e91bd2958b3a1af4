"""Whom to resize and how: `ResizeSpec`, the typed form of `config.resize`.

ZERO-resizing itself (what a resized step computes and updates) is `core.resize`; which units a
resized device keeps is `balance.priority`. A fixed schedule (`keep` or `straggler`) runs with the
`static` policy; the dynamic policies decide whom to resize and use only the "how" fields (mode,
imputation, priority, freeze, fill value, refresh interval, contraction fractions).
"""

from __future__ import annotations

import dataclasses
import math

from semijax.balance import priority as priority_lib
from semijax.core import resize as resize_lib
from semijax.errors import ConfigError


def _is_ratio(r) -> bool:
  return (isinstance(r, (int, float)) and not isinstance(r, bool) and math.isfinite(r)
          and 0 < r <= 1)


@dataclasses.dataclass(frozen=True)
class ResizeSpec:
  """How and whom to resize (`config.resize`).

  Attributes:
    keep: one keep ratio in (0, 1] per tensor device, or () to use `straggler`.
    straggler: "rotate" (device `epoch mod N`), a tuple of device indices, or "" / () (none).
    straggler_keep: the keep ratio of a straggler.
    mode, imputation: see `core.resize.MODES`, `core.resize.IMPUTATIONS`.
    priority: which units a resized device keeps (`balance.priority.PRIORITIES`).
    freeze: keep skipped weights and their optimizer moments unchanged in that step.
    fill_value: the constant of the "fill" imputation.
    epoch_steps: steps per "epoch" (rotation period; default refresh interval); 0 = one pass
      over the training data.
    refresh_every: steps between priority refreshes; 0 = `epoch_steps`.
    fractions: contraction mode: compiled keep fractions (ascending, ending at 1.0); a device
      executes its contraction at the smallest fraction >= its keep ratio.
  """

  keep: tuple[float, ...] = ()
  straggler: str | tuple[int, ...] = ""
  straggler_keep: float = 0.5
  mode: str = "units"
  imputation: str = "zero"
  priority: str = "weight_delta"
  freeze: bool = True
  fill_value: float = 1e-18
  epoch_steps: int = 0
  refresh_every: int = 0
  fractions: tuple[float, ...] = resize_lib.DEFAULT_FRACTIONS

  @property
  def scheduled(self) -> bool:
    """Whether this spec names whom to resize (a fixed schedule for the `static` policy)."""
    return bool(self.keep) or bool(self.straggler)

  def validate(self, num_devices: int) -> "ResizeSpec":
    """Raises ConfigError (naming the field) unless this spec fits `num_devices` devices."""
    f = "config.resize"
    for name, allowed in (("mode", resize_lib.MODES), ("imputation", resize_lib.IMPUTATIONS),
                          ("priority", priority_lib.PRIORITIES)):
      if getattr(self, name) not in allowed:
        raise ConfigError(f"{f}.{name}: {getattr(self, name)!r} is not one of {list(allowed)}")
    if self.keep:
      if len(self.keep) != num_devices:
        raise ConfigError(f"{f}.keep: {len(self.keep)} ratios {self.keep} for mesh.tensor = "
                          f"{num_devices} devices; give one ratio in (0, 1] per device")
      bad = [r for r in self.keep if not _is_ratio(r)]
      if bad:
        raise ConfigError(f"{f}.keep: every ratio must be in (0, 1], got {bad[0]!r}")
      if self.straggler:
        raise ConfigError(f"{f}.straggler: set either resize.keep or resize.straggler, not both")
    if isinstance(self.straggler, str):
      if self.straggler not in ("", "rotate"):
        raise ConfigError(f"{f}.straggler: {self.straggler!r} is not 'rotate' or device indices")
    else:
      bad = [d for d in self.straggler
             if isinstance(d, bool) or not isinstance(d, int) or not 0 <= d < num_devices]
      if bad:
        raise ConfigError(f"{f}.straggler: device {bad[0]!r} is not in [0, {num_devices})")
    if not _is_ratio(self.straggler_keep):
      raise ConfigError(f"{f}.straggler_keep: must be in (0, 1], got {self.straggler_keep!r}")
    fr = self.fractions
    if not fr or list(fr) != sorted(set(fr)) or fr[-1] != 1.0 or not all(_is_ratio(x) for x in fr):
      raise ConfigError(f"{f}.fractions: {fr} must be distinct ascending ratios in (0, 1] "
                        "ending at 1.0")
    for name in ("epoch_steps", "refresh_every"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{f}.{name}: must be an integer >= 0, got {v!r}")
    if not (isinstance(self.fill_value, (int, float)) and math.isfinite(self.fill_value)):
      raise ConfigError(f"{f}.fill_value: must be a finite number, got {self.fill_value!r}")
    return self

  def keep_ratios(self, step: int, num_devices: int, epoch_steps: int) -> tuple[float, ...]:
    """Keep ratio of every tensor device in 0-based `step` under the schedule (1.0 = not
    resized)."""
    if self.keep:
      return tuple(float(r) for r in self.keep)
    if self.straggler == "rotate":
      stragglers = {(step // max(epoch_steps, 1)) % num_devices}
    else:
      stragglers = set(self.straggler or ())
    return tuple(float(self.straggler_keep) if d in stragglers else 1.0
                 for d in range(num_devices))
