"""The cost model of a step: what each balancing option is predicted to cost, online.

A *setup* says what every tensor device owns and computes in a step (`Setup`). `CostModel`
predicts its step time at given relative speeds:

  step(setup) = fixed + per_load * max_d((b * load_d + repeat) / speed_d)   (bucket-quantized)

over the devices that compute any unit: a drained device (no units of any kind) skips the
repeated work too, and its speed does not count.

`load_d` is the share of the model's FLOPs that device d *executes*: its computed units of each
kind rounded up to the compiled bucket width (that is what `core.tp` runs), weighted by FLOPs per
unit (`core.spec.ModelSpec.flops_per_unit`). A resized device executes, in units mode, the bucket
width of its kept units; in contraction mode its owned width with the GEMM part of each unit's
FLOPs scaled by the compiled fraction >= its keep ratio (the attention products over the
sequence are not contracted). `b` is 1 for an exact setup in which every device executes the
same width (the single-width step, `core.plan.uniform_widths`), else 1 + `branch_overhead`
(the branched step's `lax.switch`, measured). `fixed` and `per_load` are calibrated online from
measured step times (`observe`); the move cost from a timed migration (`observe_move`).
`skipped_share` is the share of the model's work a resized setup leaves out (the learning it
skips, which the controller charges).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from semijax.core import resize as resize_lib

# The branched step over the single-width step at the same largest width, less one: measured on
# this machine at 1.00-1.07 for the benchmark's model (experiments/bench_widths.py and
# bench_breakdown.py, CPU time; each branch keeps its padded GEMM outputs, `core.kernels`). The
# forward pass rematerialized in every branch cost about 1.03-1.09 there, not the third of
# forward plus backward that rerunning every forward GEMM would.
BRANCH_OVERHEAD = 0.05
# A fitted line replaces the prior only with this many (faded) samples ...
MIN_FIT_SAMPLES = 4
# ... whose critical loads vary by at least this (relative std: a line through one x is noise) ...
MIN_LOAD_SPREAD = 0.1
# ... and only if it explains at least this share of the variance of the times (R^2).
MIN_FIT_R2 = 0.5
# Before the fit: a new step time moves per_load by at least this share of the time, so that a
# prior `fixed` that is too large cannot make the load look free.
MIN_LOAD_SHARE = 0.05
# The fit picks `repeat` on this grid (shares of the model's block work) ...
REPEAT_GRID = tuple(i / 40 for i in range(41))
# ... and leaves the value it holds (at first the prior) only where a line through another x
# leaves this much less unexplained (1 - R^2, and at least 1e-6 less): with all samples at one
# speed and the slow device critical, every `repeat` fits alike ...
MIN_REPEAT_GAIN = 0.25
# ... and only once values within `REPEAT_CONFIRM_TOL` of each other have won this many
# observations in a row: when the speeds change, the remembered samples mix two regimes and the
# grid's best can jump across the grid from one sample to the next (0.6, 0.0, 1.0, 0.075, 1.0
# at one burst's start in the benchmark), each jump a new balanced split.
REPEAT_CONFIRM = 3
REPEAT_CONFIRM_TOL = 0.1
# Bytes per second assumed for the per-step traffic of offload (weights out, gradients back):
# an order of magnitude of host-memory copies between fake CPU devices and of NVLink-class links.
OFFLOAD_BYTES_PER_S = 1e9


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

  def exact(self) -> "Setup":
    """The same ownership, every owned unit computed by its owner."""
    return Setup(self.owned, self.owned, None)

  @property
  def offloaded(self) -> bool:
    return self.computed != self.owned

  def describe(self) -> dict:
    return {"owned": {k: list(v) for k, v in self.owned.items()},
            "computed": {k: list(v) for k, v in self.computed.items()},
            "keep": None if self.keep is None else [round(k, 4) for k in self.keep]}


def busy(setup: Setup) -> np.ndarray:
  """bool [N]: the devices that compute some unit in `setup` (the others are drained)."""
  return np.any([np.asarray(c) > 0 for c in setup.computed.values()], axis=0)


def _critical_loads(work: np.ndarray, speeds: np.ndarray, computes: np.ndarray, repeat):
  """max over the last axis (devices) of (work + repeat) / speeds where `computes`, else 0:
  work, speeds, computes [..., N], broadcast against `repeat` (a scalar, or [R, 1, 1])."""
  return np.max(np.where(computes, (work + repeat) / speeds, 0.0), axis=-1)


class CostModel:
  """Predicts step seconds of a `Setup` at given speeds (see module doc).

  Args:
    unit_flops: {kind: FLOPs per unit} (any common scale).
    widths: {kind: compiled bucket widths, ascending}; a device executes the smallest >= its count.
    num_units: {kind: U}.
    fixed_fraction: share of the first measured step that does not scale with load (collectives,
      host work), until measurements say otherwise.
    repeat: prior of the work every device repeats at its own speed, in shares of the model's
      block work (0: none), until measurements say otherwise.
    fit_repeat: whether the fit may replace `repeat` (False: it fits only `fixed_s` and
      `per_load_s`, with `repeat` held).
    alpha: weight of a new measurement in `per_load_s` before the fit takes over.
    memory: samples the fit remembers (older ones fade by 1 - 1/memory per sample).
    move_s: seconds of one migration (calibrated by `observe_move`).
    bytes_per_s: bandwidth for per-step offload traffic.
    narrow: {kind: w}: an exact setup in which every device executes width w of every kind runs
      the single-width step; any other setup runs the branched one.
    branch_overhead: extra compute of the branched step per unit of load.
    resize_mode: "units" or "contraction" (`core.resize.MODES`): how a keep ratio shrinks work.
    fractions: the compiled keep fractions of the contraction mode.
    gemm_flops: {kind: the part of `unit_flops` that the contraction mode scales}; default all.
  """

  def __init__(self, unit_flops: dict, widths: dict, num_units: dict, *,
               fixed_fraction: float = 0.1, repeat: float = 0.0, fit_repeat: bool = True,
               alpha: float = 0.3,
               memory: float = 10.0,
               move_s: float = 0.0, bytes_per_s: float = OFFLOAD_BYTES_PER_S,
               narrow: dict | None = None, branch_overhead: float = BRANCH_OVERHEAD,
               resize_mode: str = "units",
               fractions: tuple = resize_lib.DEFAULT_FRACTIONS, gemm_flops: dict | None = None):
    if not 0 <= fixed_fraction < 1:
      raise ValueError(f"balance.fixed_fraction: must be in [0, 1), got {fixed_fraction}")
    if not 0 <= repeat <= REPEAT_GRID[-1]:
      raise ValueError(f"balance.repeat_share: must be in [0, {REPEAT_GRID[-1]}], got {repeat}")
    if resize_mode not in resize_lib.MODES:
      raise ValueError(f"resize.mode: {resize_mode!r} is not one of {list(resize_lib.MODES)}")
    self.unit_flops = dict(unit_flops)
    self.widths = {k: tuple(v) for k, v in widths.items()}
    self.num_units = dict(num_units)
    self.total = sum(self.unit_flops[k] * u for k, u in self.num_units.items())
    self.fixed_fraction, self.alpha = fixed_fraction, alpha
    self.forget = 1.0 - 1.0 / memory
    self.repeat = self.repeat_prior = float(repeat)
    self.fit_repeat = fit_repeat
    self._challenger = (None, 0)     # (repeat that beat the held one, wins in a row)
    self.fixed_s = None
    self.per_load_s = None
    self.move_s = move_s
    self.bytes_per_s = bytes_per_s
    self.narrow = dict(narrow or {})
    self.branch_overhead = branch_overhead
    self.resize_mode, self.fractions = resize_mode, tuple(fractions)
    gemm = self.unit_flops if gemm_flops is None else gemm_flops
    self.gemm_share = {k: (gemm.get(k, 0.0) / f if f else 1.0) for k, f in self.unit_flops.items()}
    # The remembered steps, newest last: weights [S], work [S, N], speeds [S, N], seconds [S];
    # and their critical loads x [R, S] at each repeat of the grid `_x_grid` (`_fits`).
    self._w = self._y = np.zeros(0)
    self._work = self._speeds = np.zeros((0, 0))
    self._busy = np.zeros((0, 0), bool)
    self._x, self._x_grid = np.zeros((0, 0)), None
    self._last = None        # (setup, work, busy) of the last `observe`: a run repeats its setup

  def executed(self, kind: str, count: int) -> int:
    """The bucket width a device with `count` computed units of `kind` executes."""
    if count <= 0:
      return 0
    w = self.widths[kind]
    return next((x for x in w if x >= count), w[-1])

  def _own_work(self, kind: str, own: int, keep: float | None) -> float:
    """Executed work of a device's own `own` units of `kind` (in units of full-unit work)."""
    if keep is None or keep >= 1.0:
      return self.executed(kind, own)
    if self.resize_mode == "units":
      return self.executed(kind, resize_lib.kept_count(keep, own))
    frac = self.fractions[resize_lib.fraction_index(keep, self.fractions)]
    share = self.gemm_share[kind]
    return self.executed(kind, own) * (share * frac + 1.0 - share)

  def loads(self, setup: Setup) -> np.ndarray:
    """float [N]: share of all FLOPs each device executes (own units + units it helps with)."""
    n = len(next(iter(setup.owned.values())))
    out = np.zeros(n)
    for kind, computed in setup.computed.items():
      for d in range(n):
        own = min(computed[d], setup.owned[kind][d])
        keep = None if setup.keep is None else setup.keep[d]
        helped = max(computed[d] - setup.owned[kind][d], 0)
        out[d] += self.unit_flops[kind] * (self._own_work(kind, own, keep) + helped)
    return out / self.total

  def skipped_share(self, setup: Setup) -> float:
    """Share of the model's block work (owned units, FLOPs-weighted) that `setup` leaves out:
    0 for an exact setup; skipped units (units mode) or the skipped part of each GEMM's
    contraction (contraction mode) of every resized device."""
    if setup.keep is None:
      return 0.0
    skipped = 0.0
    for kind, owned in setup.owned.items():
      for d, own in enumerate(owned):
        keep = setup.keep[d]
        if keep >= 1.0 or own <= 0:
          continue
        if self.resize_mode == "units":
          units = own - resize_lib.kept_count(keep, own)
        else:
          frac = self.fractions[resize_lib.fraction_index(keep, self.fractions)]
          units = own * self.gemm_share[kind] * (1.0 - frac)
        skipped += self.unit_flops[kind] * units
    return skipped / self.total

  def branched(self, setup: Setup) -> bool:
    """Whether `setup` runs the branched (rematerializing) step while a single-width one exists
    (without `narrow`, every setup runs the same kind of step: False)."""
    if not self.narrow:
      return False
    if setup.keep is not None or setup.offloaded:
      return True
    return any(self.executed(k, c) != self.narrow.get(k)
               for k, counts in setup.owned.items() for c in counts)

  def work(self, setup: Setup) -> np.ndarray:
    """float [N]: each device's block work per step (`loads`, times 1 + `branch_overhead` for
    the branched step), without the repeated work."""
    factor = 1 + self.branch_overhead if self.branched(setup) else 1.0
    return factor * self.loads(setup)

  def critical(self, setup: Setup, speeds) -> float:
    """max_d (work_d + repeat) / speed_d over the devices that compute (`busy`): the slowest
    device's work per step, in shares of the model's block work at full speed, with the
    calibrated `repeat`."""
    return self._critical(self.work(setup), np.asarray(speeds, np.float64), busy(setup))

  def _critical(self, work: np.ndarray, speeds: np.ndarray, computes: np.ndarray) -> float:
    return float(_critical_loads(work, speeds, computes, self.repeat))

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

    For every `repeat` on `REPEAT_GRID`, a least-squares line through the recent
    (critical load, seconds) points (older points fade by `forget` per sample) gives `fixed_s`
    and `per_load_s`. Once there are `MIN_FIT_SAMPLES` points, the load has varied
    (`MIN_LOAD_SPREAD`) and a line explains the times (`MIN_FIT_R2`), the fit takes over: with
    the `repeat` it holds (at first the prior); the grid's best replaces it only where its
    unexplained variance is `MIN_REPEAT_GAIN` below the held one's, or the held line is not
    trusted, in `REPEAT_CONFIRM` observations in a row (`_hold_or_switch`). So the held value,
    and with it the balanced split, does not swing between near-equal fits as samples come and
    fade, nor across the grid while the samples mix two speed regimes: such swings made `semi`
    migrate back and forth at the start of a burst. Otherwise (no trusted line for the held
    value) `fixed_s` stays (at first `fixed_fraction` of the first step) and `per_load_s`
    follows the measurements.
    """
    y = measured_s
    if self._last is None or self._last[0] != setup:
      self._last = setup, self.work(setup), busy(setup)
    _, work, computes = self._last
    speeds = np.asarray(speeds, np.float64)
    grid = sorted({self.repeat_prior, *REPEAT_GRID} if self.fit_repeat else {self.repeat})
    repeats = np.asarray(grid)
    # The step's critical load at every repeat of the grid, the held one's (`_critical`) among
    # them (the held repeat is the prior or a fit's, on the grid).
    column = _critical_loads(work, speeds, computes, repeats[:, None])   # [R]
    x = float(column[grid.index(self.repeat)])
    if not (y > 0 and math.isfinite(y)) or x <= 0:
      return
    keep = self._w * self.forget > 1e-3
    if self._work.shape[1:] != work.shape:
      keep[:] = False
      self._work = self._speeds = np.zeros((0, len(work)))
      self._busy = np.zeros((0, len(work)), bool)
    self._w = np.concatenate([self._w[keep] * self.forget, [1.0]])
    self._work = np.concatenate([self._work[keep], work[None]])
    self._speeds = np.concatenate([self._speeds[keep], speeds[None]])
    self._busy = np.concatenate([self._busy[keep], computes[None]])
    self._y = np.concatenate([self._y[keep], [y]])
    if grid == self._x_grid and self._x.shape[1] == len(keep):
      # The remembered steps' loads do not change: only the new step's are added (in C order,
      # as `_loads_at` gives them: the products in `_fits` depend on the layout).
      self._x = np.ascontiguousarray(np.concatenate([self._x[:, keep], column[:, None]], axis=1))
    else:
      self._x, self._x_grid = self._loads_at(repeats), grid
    lines = {r: f for r, f in zip(grid, self._fits(repeats, self._x)) if f is not None}
    fits = {r: f[:3] for r, f in lines.items() if f[3]}
    held = lines.get(self.repeat)
    self._hold_or_switch(fits, held[2] if held is not None and held[1] > 0 else None)
    if self.repeat in fits:
      self.fixed_s, self.per_load_s, _ = fits[self.repeat]
      return
    if self.fixed_s is None:
      self.fixed_s = self.fixed_fraction * y
      self.per_load_s = (y - self.fixed_s) / x
      return
    b = max(y - self.fixed_s, MIN_LOAD_SHARE * y) / x
    self.per_load_s = (1 - self.alpha) * self.per_load_s + self.alpha * b

  def _hold_or_switch(self, fits: dict, held: float | None) -> None:
    """Moves `repeat` to the grid's best fit once it has left `MIN_REPEAT_GAIN` less variance
    unexplained than the held value's line, in `REPEAT_CONFIRM` observations in a row, its
    winners within `REPEAT_CONFIRM_TOL` of each other.

    Args:
      fits: {repeat: (fixed_s, per_load_s, 1 - R^2)}: the trusted lines of this observation.
      held: 1 - R^2 of the held value's line, trusted or not (a noisy intercept below zero does
        not refute it), or None where it has no rising line.
    """
    if not fits:
      self._challenger = (None, 0)
      return
    best = min(fits, key=lambda r: fits[r][2])
    if held is not None and held - fits[best][2] <= max(MIN_REPEAT_GAIN * held, 1e-6):
      self._challenger = (None, 0)
      return
    last, wins = self._challenger
    wins = wins + 1 if last is not None and abs(best - last) <= REPEAT_CONFIRM_TOL else 1
    self._challenger = (best, wins)
    if wins >= REPEAT_CONFIRM:
      self.repeat, self._challenger = best, (None, 0)

  def _loads_at(self, repeats: np.ndarray) -> np.ndarray:
    """x [R, S]: each remembered step's critical load with each of `repeats` [R]."""
    return _critical_loads(self._work[None], self._speeds[None], self._busy[None],
                           repeats[:, None, None])

  def _fits(self, repeats: np.ndarray, x: np.ndarray | None = None) -> list:
    """For each of `repeats` [R]: (fixed_s, per_load_s, 1 - R^2, trusted) of the line through
    the remembered points with that `repeat`, or None where there are too few points or the
    load has not varied; `trusted` as in `observe` (a rising line through a non-negative
    intercept that explains `MIN_FIT_R2` of the variance). `x`: `_loads_at(repeats)` if known."""
    w, y = self._w, self._y
    n = w.sum()
    if n < MIN_FIT_SAMPLES:
      return [None] * len(repeats)
    x = self._loads_at(repeats) if x is None else x                      # [R, S]
    mx, my = x @ w / n, (w * y).sum() / n
    dx, dy = x - mx[:, None], y - my
    var, vary = (dx ** 2) @ w / n, (w * dy ** 2).sum() / n
    cov = dx @ (w * dy) / n
    # Every repeat's line at once (elementwise: the same arithmetic as one at a time).
    fitted = (var > (MIN_LOAD_SPREAD * mx) ** 2) & (vary > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
      b = cov / var
      a = my - b * mx
      r2 = cov * cov / (var * vary)
    trusted = (b > 0) & (0 <= a) & (a < my) & (r2 >= MIN_FIT_R2)
    return [(a_, b_, 1.0 - r2_, t) if f else None for f, a_, b_, r2_, t in zip(
        fitted.tolist(), a.tolist(), b.tolist(), r2.tolist(), trusted.tolist())]

  def observe_move(self, seconds: float) -> None:
    self.move_s = (seconds if self.move_s <= 0
                   else (1 - self.alpha) * self.move_s + self.alpha * seconds)
