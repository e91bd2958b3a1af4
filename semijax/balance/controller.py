"""SEMI-migration: the cost model and the controller that picks how to balance, online.

A *setup* says what every tensor device owns and computes in a step (`Setup`). The controller
knows the current setup and the measured relative speeds; it builds candidate setups and predicts
the step time of each with `CostModel`:

  step(setup) = fixed + per_load * b * max_d(load_d / speed_d)      (compute, bucket-quantized)
              + per-step extra (offload: weights out, gradients back)
              + move cost / expected steps                          (migration, amortized)
              + resize_penalty * compute                            (resizing costs accuracy)

`load_d` is the share of the model's FLOPs that device d *executes*: its computed units of each
kind rounded up to the compiled bucket width (that is what `tp` runs), weighted by FLOPs per unit.
`b` is 1 for an exact setup in which every device executes the same width (the single-width
step, `plan_lib.uniform_widths`), else 1 + `branch_overhead` (per-device branches rematerialize the
forward pass).
`fixed` and `per_load` are calibrated online from measured step times; the move cost from a timed
migration. A migration is amortized over how long the current speeds are expected to last
(`speed.SpeedTracker.expected_remaining_s`) and charged twice while someone is slow (there and,
later, back). Candidates:

  exact    the current ownership, every owned unit computed;
  resize   the current ownership, slow devices keep part of their units (ZERO-resizing), at most
           `resize_budget` of them skipped (the `resize` policy: `resize_keep` while slow). The
           accuracy budget also bounds time: `semi` resizes only while the slowdown is expected
           to end within `resize_horizon_steps`; a longer one is balanced without loss or not
           at all (resizing would otherwise win forever, being free to start);
  migrate  ownership by speed on the bucket widths (`layout.bucketed_counts`), moved once;
  offload  ownership unchanged, slow devices' surplus computed by helpers every step.

Hysteresis: a change must beat the current setup by `hysteresis` (relative) in `patience`
consecutive decisions (or in the first decision after the tracker confirmed a new regime of
speeds: its change detection already told a lasting change from noise), and migrations are at
least `min_dwell_steps` apart; while a migration waits, the best setup that moves nothing is
used (so a new slowdown is first resized, then migrated once migrating pays). Leaving resizing
for an exact setup (exact, or migrate when it is predicted faster) needs no margin (and migrate
no patience), since resizing costs accuracy. Every decision carries its reason and its
predictions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np

from semijax.core import layout as layout_lib
from semijax.core import resize as resize_lib

BRANCH_OVERHEAD = 1 / 3
MIN_FIT_SAMPLES = 4       # (faded) samples before a fitted line may replace the prior
POLICIES = ("even", "static", "resize", "migrate", "offload", "semi")
CANDIDATE_NAMES = ("exact", "resize", "migrate", "offload")
CANDIDATES = {"resize": ("exact", "resize"), "migrate": ("exact", "migrate"),
              "offload": ("exact", "offload"), "semi": ("exact", "resize", "migrate")}


@dataclasses.dataclass(frozen=True)
class Setup:
  """What each tensor device owns and computes in a step (host description).

  Attributes:
    owned: {kind: units owned per device} (a layout's counts).
    computed: {kind: units computed per device}; differs from `owned` only with offload.
    keep: resize keep ratio per device, or None (every computed unit is computed).
  """

  owned: dict
  computed: dict
  keep: tuple | None = None

  @classmethod
  def of(cls, owned: dict) -> "Setup":
    owned = {k: tuple(int(c) for c in v) for k, v in owned.items()}
    return cls(owned, owned, None)

  @property
  def offloaded(self) -> bool:
    return self.computed != self.owned

  def describe(self) -> dict:
    return {"owned": {k: list(v) for k, v in self.owned.items()},
            "computed": {k: list(v) for k, v in self.computed.items()},
            "keep": None if self.keep is None else [round(k, 4) for k in self.keep]}


class CostModel:
  """Predicts step seconds of a `Setup` at given speeds (see module doc).

  Args:
    unit_flops: {kind: FLOPs per unit} (any common scale; `hetero.flops_per_unit`).
    widths: {kind: compiled bucket widths, ascending}; a device executes the smallest >= its count.
    num_units: {kind: U}.
    fixed_fraction: share of the first measured step that does not scale with load (collectives,
      embeddings, the optimizer), until measurements say otherwise.
    alpha: EWMA weight of a new measurement.
    move_s: seconds of one migration (calibrated by `observe_move`).
    bytes_per_s: bandwidth for per-step offload traffic.
    narrow: {kind: w}: an exact setup in which every device executes width w of every kind runs
      the single-width step (`plan_lib.uniform_widths`); any other setup runs the branched one.
    branch_overhead: extra compute of the branched step per unit of load (it rematerializes the
      forward pass, a third of forward plus backward).
  """

  def __init__(self, unit_flops: dict, widths: dict, num_units: dict, *,
               fixed_fraction: float = 0.1, alpha: float = 0.3, move_s: float = 0.0,
               bytes_per_s: float = 1e9, narrow: dict | None = None,
               branch_overhead: float = BRANCH_OVERHEAD):
    if not 0 <= fixed_fraction < 1:
      raise ValueError(f"balance.fixed_fraction: must be in [0, 1), got {fixed_fraction}")
    self.unit_flops = dict(unit_flops)
    self.widths = {k: tuple(v) for k, v in widths.items()}
    self.num_units = dict(num_units)
    self.total = sum(self.unit_flops[k] * u for k, u in self.num_units.items())
    self.fixed_fraction, self.alpha = fixed_fraction, alpha
    self.fixed_s = None
    self.per_load_s = None
    self.move_s = move_s
    self.bytes_per_s = bytes_per_s
    self.narrow = dict(narrow or {})
    self.branch_overhead = branch_overhead
    self.forget = 0.9
    self._sums = np.zeros(5)   # faded sums of 1, x, y, x^2, xy (see observe)
    self._sums_y2 = 0.0

  def executed(self, kind: str, count: int) -> int:
    """The bucket width a device with `count` computed units of `kind` executes."""
    if count <= 0:
      return 0
    w = self.widths[kind]
    return next((x for x in w if x >= count), w[-1])

  def loads(self, setup: Setup) -> np.ndarray:
    """float [N]: share of all FLOPs each device executes (own units + units it helps with)."""
    n = len(next(iter(setup.owned.values())))
    out = np.zeros(n)
    for kind, computed in setup.computed.items():
      for d in range(n):
        own = min(computed[d], setup.owned[kind][d])
        if setup.keep is not None:
          own = resize_lib.kept_count(setup.keep[d], own)
        helped = max(computed[d] - setup.owned[kind][d], 0)
        out[d] += self.unit_flops[kind] * (self.executed(kind, own) + helped)
    return out / self.total

  def branched(self, setup: Setup) -> bool:
    """Whether `setup` runs the branched (rematerializing) step while a single-width one exists
    (without `narrow`, every setup runs the same kind of step: False)."""
    if not self.narrow:
      return False
    if setup.keep is not None or setup.offloaded:
      return True
    return any(self.executed(k, c) != self.narrow.get(k)
               for k, counts in setup.owned.items() for c in counts)

  def critical(self, setup: Setup, speeds) -> float:
    """max_d load_d / speed_d, times 1 + `branch_overhead` for the branched step."""
    factor = 1 + self.branch_overhead if self.branched(setup) else 1.0
    return factor * float(np.max(self.loads(setup) / np.asarray(speeds, np.float64)))

  def offload_bytes(self, setup: Setup, unit_bytes: dict) -> float:
    """Bytes sent per step for offloaded units: their weights out and gradients back."""
    return float(sum(2 * unit_bytes.get(k, 0.0) * max(c - o, 0)
                     for k in setup.owned for c, o in zip(setup.computed[k], setup.owned[k])))

  @property
  def calibrated(self) -> bool:
    return self.per_load_s is not None

  def compute_s(self, setup: Setup, speeds) -> float:
    if not self.calibrated:
      raise RuntimeError("CostModel: observe at least one step before predicting")
    return self.fixed_s + self.per_load_s * self.critical(setup, speeds)

  def observe(self, setup: Setup, speeds, measured_s: float) -> None:
    """Calibrates from one measured step (without migration time) of `setup` at `speeds`.

    A least-squares line through recent (critical load, seconds) points (older points fade by
    `forget` per step) gives `fixed_s` and `per_load_s` once there are `MIN_FIT_SAMPLES` of them
    and the load has varied (std above 10%)
    and the line explains at least half the variance of the times; otherwise `fixed_s` stays
    (at first `fixed_fraction` of the first step) and `per_load_s` follows the measurements.
    """
    x = self.critical(setup, speeds)
    y = measured_s
    if not (y > 0 and math.isfinite(y)) or x <= 0:
      return
    self._sums = self._sums * self.forget + np.array([1.0, x, y, x * x, x * y])
    self._sums_y2 = self._sums_y2 * self.forget + y * y
    n, sx, sy, sxx, sxy = self._sums
    mx, my = sx / n, sy / n
    var = sxx / n - mx * mx
    vary = self._sums_y2 / n - my * my
    if n >= MIN_FIT_SAMPLES and var > (0.1 * mx) ** 2 and vary > 0:
      cov = sxy / n - mx * my
      b = cov / var
      a = my - b * mx
      if b > 0 and 0 <= a < my and cov * cov / (var * vary) >= 0.5:   # the line explains the data
        self.fixed_s, self.per_load_s = a, b
        return
    if self.fixed_s is None:
      self.fixed_s = self.fixed_fraction * y
      self.per_load_s = (y - self.fixed_s) / x
      return
    b = max(y - self.fixed_s, 0.05 * y) / x
    self.per_load_s = (1 - self.alpha) * self.per_load_s + self.alpha * b

  def observe_move(self, seconds: float) -> None:
    self.move_s = seconds if self.move_s <= 0 else (1 - self.alpha) * self.move_s + self.alpha * seconds


@dataclasses.dataclass(frozen=True)
class Settings:
  """Controller knobs (`config.balance`)."""

  policy: str = "semi"
  hysteresis: float = 0.05
  patience: int = 2
  min_dwell_steps: int = 5
  slow_threshold: float = 0.85
  resize_budget: float = 0.5
  resize_keep: float = 0.5
  resize_penalty: float = 0.05
  resize_horizon_steps: float = 8
  keep_grid: int = 8

  def validate(self) -> "Settings":
    f = "config.balance"
    if self.policy not in POLICIES:
      raise ValueError(f"{f}.policy: {self.policy!r} is not one of {list(POLICIES)}")
    for name, lo, hi in (("hysteresis", 0, 1), ("slow_threshold", 0, 1), ("resize_budget", 0, 1),
                         ("resize_penalty", 0, 1)):
      v = getattr(self, name)
      if not lo <= v < hi:
        raise ValueError(f"{f}.{name}: must be in [{lo}, {hi}), got {v!r}")
    if not 0 < self.resize_keep <= 1:
      raise ValueError(f"{f}.resize_keep: must be in (0, 1], got {self.resize_keep!r}")
    if not self.resize_horizon_steps >= 0:
      raise ValueError(f"{f}.resize_horizon_steps: must be >= 0, got {self.resize_horizon_steps!r}")
    for name in ("patience", "keep_grid"):
      if getattr(self, name) < 1:
        raise ValueError(f"{f}.{name}: must be >= 1, got {getattr(self, name)!r}")
    if self.min_dwell_steps < 0:
      raise ValueError(f"{f}.min_dwell_steps: must be >= 0, got {self.min_dwell_steps!r}")
    return self


@dataclasses.dataclass(frozen=True)
class Decision:
  """One controller decision (logged as a JSON line)."""

  step: int
  choice: str                   # the candidate taken: exact | resize | migrate | offload
  setup: Setup
  changed: bool                 # the setup differs from the previous step's
  moves: bool                   # the change migrates ownership
  reason: str
  predicted_s: dict             # {candidate: predicted seconds per step, amortized}
  speeds: tuple
  expected_s: float             # expected remaining duration of the current speeds

  def to_json(self) -> dict:
    return {"step": self.step, "choice": self.choice, "changed": self.changed,
            "moves": self.moves, "reason": self.reason,
            "predicted_s": {k: round(v, 6) for k, v in self.predicted_s.items()},
            "speeds": [round(s, 4) for s in self.speeds], "expected_s": round(self.expected_s, 3),
            **self.setup.describe()}


class Controller:
  """Chooses the setup of every step (see module doc).

  Args:
    settings: `Settings` (policy among resize, migrate, offload, semi).
    cost: a `CostModel`.
    initial: the setup the run starts in.
    capacity: {kind: most units one device may own} (the compiled bucket's capacity).
    unit_bytes: {kind: bytes of one unit's weights} (offload traffic).
  """

  def __init__(self, settings: Settings, cost: CostModel, initial: Setup, capacity: dict,
               unit_bytes: dict | None = None):
    settings.validate()
    if settings.policy not in CANDIDATES:
      raise ValueError(f"config.balance.policy: {settings.policy!r} needs no controller")
    self.settings, self.cost, self.setup = settings, cost, initial
    self.capacity = dict(capacity)
    self.unit_bytes = dict(unit_bytes or {})
    self.last_move_step = -10 ** 9
    self._streak = (None, 0)   # (candidate waiting for patience, consecutive wins)

  # --- candidates -----------------------------------------------------------------------------

  def target_counts(self, speeds) -> dict:
    """{kind: units per device} for `speeds`: the fastest split on the compiled bucket widths
    (`layout.bucketed_counts`), at most the capacity each."""
    return {k: layout_lib.bucketed_counts(
        self.cost.num_units[k], speeds, [w for w in self.cost.widths[k] if w <= self.capacity[k]])
            for k in self.cost.num_units}

  def resize_keep(self, owned: dict, speeds) -> tuple | None:
    """Keep ratios for the slow devices, or None if nobody is slow.

    `resize` policy: the fixed `resize_keep` on every slow device. `semi`: for each slow device the
    largest ratio on a 1/keep_grid grid (at least 1 - resize_budget) whose time does not exceed
    the slowest fast device's.
    """
    s = self.settings
    speeds = np.asarray(speeds, np.float64)
    slow = speeds < s.slow_threshold
    if not slow.any():
      return None
    if s.policy == "resize":
      return tuple(s.resize_keep if d else 1.0 for d in slow)
    exact = Setup(owned, owned, None)
    loads = self.cost.loads(exact)
    target = float(np.max(np.where(slow, 0.0, loads / speeds)))
    floor = 1.0 - s.resize_budget
    keep = []
    for d in range(len(speeds)):
      k = 1.0
      if slow[d]:
        grid = [g / s.keep_grid for g in range(s.keep_grid, 0, -1) if g / s.keep_grid >= floor - 1e-9]
        k = grid[-1]
        for g in grid:
          one = tuple(g if i == d else 1.0 for i in range(len(speeds)))
          if self.cost.loads(Setup(owned, owned, one))[d] / speeds[d] <= target + 1e-12:
            k = g
            break
      keep.append(k)
    return None if all(k == 1.0 for k in keep) else tuple(keep)

  def candidates(self, speeds, expected_steps: float = 0.0) -> dict:
    """{name: Setup} this policy may switch to now (semi resizes only within the horizon)."""
    owned = self.setup.owned
    out = {"exact": Setup(owned, owned, None)}
    allowed = CANDIDATES[self.settings.policy]
    within = (self.settings.policy != "semi"
              or expected_steps <= self.settings.resize_horizon_steps)
    if "resize" in allowed and within and (keep := self.resize_keep(owned, speeds)) is not None:
      out["resize"] = Setup(owned, owned, keep)
    target = self.target_counts(speeds)
    if "migrate" in allowed and target != owned:
      out["migrate"] = Setup(target, target, None)
    if "offload" in allowed and target != owned:
      out["offload"] = Setup(owned, target, None)
    return out

  # --- prediction -----------------------------------------------------------------------------

  def predict(self, setup: Setup, speeds, expected_steps: float) -> float:
    """Predicted seconds per step of `setup`, including its amortized switching cost."""
    s = self.settings
    t = self.cost.compute_s(setup, speeds)
    if setup.keep is not None:
      t *= 1 + s.resize_penalty
    if setup.offloaded:
      t += self.cost.offload_bytes(setup, self.unit_bytes) / self.cost.bytes_per_s
    if setup.owned != self.setup.owned:
      trips = 2 if np.min(speeds) < s.slow_threshold else 1
      t += trips * self.cost.move_s / max(expected_steps, 1.0)
    return t

  # --- deciding -------------------------------------------------------------------------------

  def decide(self, step: int, speeds: Sequence[float], expected_s: float,
             step_s: float, new_regime: bool = False) -> Decision:
    """The setup for `step`, given relative `speeds` [N], the expected remaining seconds of these
    speeds, the recent measured seconds per step and whether the speeds are a newly confirmed
    regime (`speed.SpeedTracker.update` returned True since the last decision)."""
    s = self.settings
    speeds = np.asarray(speeds, np.float64)
    expected_steps = expected_s / max(step_s, 1e-9)
    cands = self.candidates(speeds, expected_steps)
    pred = {name: self.predict(c, speeds, expected_steps) for name, c in cands.items()}
    current = self._current_name()
    now = self.predict(self.setup, speeds, expected_steps)
    pred_now = {"current": now, **pred}
    slowest = int(np.argmin(speeds))
    context = (f"device {slowest} at speed {speeds[slowest]:.2f}, expected {expected_s:.1f} s "
               f"(~{expected_steps:.0f} steps) more")
    if s.policy == "resize":        # the authors' setting: resize exactly while someone is slow
      choice = "resize" if "resize" in cands else "exact"
      reason = f"resize policy: {'resize' if choice == 'resize' else 'nobody slow'}; {context}"
    else:
      choice, reason = self._choose(step, cands, pred, current, now, context, new_regime)
    new = cands.get(choice, self.setup)    # the same candidate may adjust its keep ratios
    moves = new.owned != self.setup.owned
    changed = new != self.setup
    if moves:
      self.last_move_step = step
    if changed and self._streak[0] == choice:
      self._streak = (None, 0)
    self.setup = new
    return Decision(step, choice, new, changed, moves, reason, pred_now,
                    tuple(float(x) for x in speeds), float(expected_s))

  def _choose(self, step, cands, pred, current, now, context,
              new_regime=False) -> tuple[str, str]:
    """(candidate, reason) under hysteresis, patience and dwell (see module doc)."""
    s = self.settings
    best = min(pred, key=pred.get)
    if best == current:
      self._streak = (None, 0)
      return current, f"stay {current}: nothing predicted faster; {context}"
    gain = 1 - pred[best] / now
    moving = cands[best].owned != self.setup.owned
    if current == "resize" and best == "exact":     # stop resizing at once: it costs accuracy
      why = ("resizing no longer pays" if "resize" in cands else
             "resizing is beyond its horizon, exact is the fastest lossless option")
      return best, f"exact: {why} ({pred[best]:.4g} vs {now:.4g} s/step); {context}"
    # Resizing already waited for its patience; trading it for a lossless split needs none.
    from_resize = current == "resize" and best == "migrate"
    if gain < s.hysteresis and not from_resize:
      why = f"{best} gains {gain:.1%} < hysteresis {s.hysteresis:.0%}"
    else:
      streak = self._streak[1] + 1 if self._streak[0] == best else 1
      self._streak = (best, streak)
      dwell = step - self.last_move_step
      if streak < s.patience and not from_resize and not new_regime:
        why = f"{best} wins {streak}/{s.patience} decisions"
      elif moving and dwell < s.min_dwell_steps:
        why = f"last migration {dwell} steps ago < {s.min_dwell_steps}"
      else:
        why = f"{gain:.1%} faster" if gain > 0 else f"{current} is no longer allowed"
        if new_regime and streak < s.patience:
          why += ", new regime: no patience"
        return best, f"{best} predicted {pred[best]:.4g} s/step vs {now:.4g} now ({why}); {context}"
    # While waiting, take the best option that moves nothing (e.g. resize before migrating).
    still = {n: p for n, p in pred.items() if cands[n].owned == self.setup.owned}
    alt = min(still, key=still.get)
    if current not in cands:        # the current setup is no longer allowed (e.g. resize horizon)
      return alt, f"{alt}: {current} is no longer allowed (hold: {why}); {context}"
    if alt != current and alt != best and pred[alt] < now * (1 - s.hysteresis):
      return alt, f"{alt} meanwhile ({pred[alt]:.4g} s/step; hold: {why}); {context}"
    return current, f"stay {current} (hold: {why}); {context}"

  def _current_name(self) -> str:
    if self.setup.keep is not None:
      return "resize"
    if self.setup.offloaded:
      return "offload"
    return "exact"
