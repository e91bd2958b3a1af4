"""SEMI-migration's controller: predicts every option with the cost model and picks one, online.

The controller knows the current `cost.Setup` and the measured relative speeds. Its policy
(`balance.policies`) proposes candidate setups besides `exact` (the current ownership, every
owned unit computed); the controller predicts each one's step time (`predict`) and the policy
chooses among them, normally with `choose_with_hysteresis`:

  a change must beat the current setup by `hysteresis` (relative) in `patience` consecutive
  decisions (a decision in which it does not resets the count), or in the first decision after
  the tracker confirmed a new regime of speeds (its change detection already told a lasting
  change from noise); migrations are at least `min_dwell_steps` apart; while a migration waits,
  the best setup that moves nothing is used (so a new slowdown is first resized, then migrated
  once migrating pays). Leaving resizing for an exact setup (exact, or migrate when it is
  predicted faster) needs no margin (and migrate no patience), since resizing costs accuracy.

A migration is amortized over how long the current speeds are expected to last
(`speed.SpeedTracker.expected_remaining_s`) and charged twice while someone is slow (there and,
later, back). Resizing costs accuracy, so it must earn it: a resized step that leaves out a
share f of the model's work (`cost.CostModel.skipped_share`) makes about 1 - f of a step's
progress, so its predicted time is divided by 1 - f (and raised by `resize_penalty`); and the
controller keeps a running budget (`skip_budget`): the work skipped so far (in steps' worth of
the whole model) stays below `skip_budget` x the steps run so far, so a run never resizes in
its first steps and never skips more than that share overall (`within_skip_budget`).
Every decision carries its reason and its predictions.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from semijax.balance import cost as cost_lib
from semijax.balance import settings as settings_lib
from semijax.core import layout as layout_lib

CANDIDATE_NAMES = ("exact", "resize", "migrate", "offload")
Setup = cost_lib.Setup


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
  skipped_steps: float = 0.0    # work resizing skipped before this step, in whole-model steps

  @property
  def drained(self) -> list[int]:
    """The devices that compute nothing in this setup."""
    return [int(d) for d in np.flatnonzero(~cost_lib.busy(self.setup))]

  def to_json(self) -> dict:
    return {"step": self.step, "choice": self.choice, "changed": self.changed,
            "drained": self.drained,
            "moves": self.moves, "reason": self.reason,
            "predicted_s": {k: round(v, 6) for k, v in self.predicted_s.items()},
            "speeds": [round(s, 4) for s in self.speeds], "expected_s": round(self.expected_s, 3),
            "skipped_steps": round(self.skipped_steps, 4), **self.setup.describe()}


@dataclasses.dataclass(frozen=True)
class Options:
  """What one decision weighs: the candidates, their predictions and the current setup."""

  step: int
  candidates: dict              # {name: Setup}, "exact" always among them
  predicted: dict               # {name: predicted seconds per step}
  current: str                  # the name of the current setup's kind
  now: float                    # the current setup's predicted seconds per step
  context: str                  # the speeds and expected duration, for reasons
  new_regime: bool


class Controller:
  """Chooses the setup of every step for a policy (see module doc).

  Args:
    policy: a controlled `balance.policies.Policy` (proposes candidates and chooses).
    settings: the run's `BalanceSettings`.
    cost: a `cost.CostModel`.
    initial: the setup the run starts in.
    capacity: {kind: most units one device may own} (the big bucket's capacity).
    unit_bytes: {kind: bytes of one unit's weights} (offload traffic).
  """

  def __init__(self, policy, settings: settings_lib.BalanceSettings, cost: cost_lib.CostModel,
               initial: Setup, capacity: dict, unit_bytes: dict | None = None):
    self.policy, self.settings, self.cost, self.setup = policy, settings, cost, initial
    self.capacity = dict(capacity)
    self.unit_bytes = dict(unit_bytes or {})
    self.last_move_step = -10 ** 9
    self._streak = (None, 0)   # (candidate waiting for patience, consecutive wins)
    self.step = 0              # the step being decided
    self.skipped_steps = 0.0   # work skipped so far, in whole-model steps (see `account`)
    self._counted = None       # the step up to which skipped work is counted

  # --- what the policies build candidates from ------------------------------------------------

  def target_counts(self, speeds) -> dict:
    """{kind: units per device} for `speeds`: the fastest split on the compiled bucket widths
    (`layout.bucketed_counts`), at most the capacity each, with the cost model's repeated work
    (a share of all units of each kind, every device at its own speed: water-filling). A
    moving policy whose bucket compiles the width 0 may also leave devices without units
    (drained: no repeated work either) where the cost model finds that faster."""
    widths = {k: [w for w in self.cost.widths[k] if w <= self.capacity[k]]
              for k in self.cost.num_units}
    split = lambda minimum: {k: layout_lib.bucketed_counts(
        u, speeds, widths[k], offset=self.cost.repeat * u, minimum=minimum)
                             for k, u in self.cost.num_units.items()}
    kept = split(1)
    if not (self.policy.moves and all(0 in w for w in widths.values())):
      return kept
    drained = split(0)
    critical = lambda counts: self.cost.critical(Setup.of(counts), speeds)
    return drained if critical(drained) < critical(kept) else kept

  def equalizing_keep(self, owned: dict, speeds) -> tuple | None:
    """Keep ratios that make each slow device about as fast as the slowest fast device: the
    largest ratio on a 1/keep_grid grid (at least 1 - resize_budget) whose predicted time does
    not exceed it; None if nobody is slow."""
    s = self.settings
    speeds = np.asarray(speeds, np.float64)
    slow = speeds < s.slow_threshold
    if not slow.any():
      return None
    exact = Setup(owned, owned, None)
    repeat = self.cost.repeat
    idle = slow | ~cost_lib.busy(exact)
    target = float(np.max(np.where(idle, 0.0, (self.cost.loads(exact) + repeat) / speeds)))
    floor = 1.0 - s.resize_budget
    grid = [g / s.keep_grid for g in range(s.keep_grid, 0, -1) if g / s.keep_grid >= floor - 1e-9]
    keep = []
    for d in range(len(speeds)):
      k = 1.0
      if slow[d]:
        k = grid[-1]
        for g in grid:
          one = tuple(g if i == d else 1.0 for i in range(len(speeds)))
          if (self.cost.loads(Setup(owned, owned, one))[d] + repeat) / speeds[d] <= target + 1e-12:
            k = g
            break
      keep.append(k)
    return None if all(k == 1.0 for k in keep) else tuple(keep)

  # --- the accuracy budget ----------------------------------------------------------------------

  def account(self, step: int) -> None:
    """Adds the work the current setup skipped in the steps before 0-based `step`."""
    if self._counted is not None and step > self._counted:
      self.skipped_steps += self.cost.skipped_share(self.setup) * (step - self._counted)
    self._counted = step if self._counted is None else max(self._counted, step)

  def within_skip_budget(self, setup: Setup) -> bool:
    """Whether one more step of `setup` keeps the skipped work within `skip_budget` of the
    steps run so far (always, for a setup that skips nothing)."""
    share = self.cost.skipped_share(setup)
    return share == 0 or (self.skipped_steps + share
                          <= self.settings.skip_budget * (self.step + 1) + 1e-12)

  def migration_pays(self, migrate: Setup | None, speeds, expected_steps: float) -> bool:
    """Whether `migrate` (or None) is predicted, amortized, faster than the exact current split
    by the hysteresis."""
    if migrate is None:
      return False
    exact = self.predict(self.setup.exact(), speeds, expected_steps)
    return self.predict(migrate, speeds, expected_steps) < exact * (1 - self.settings.hysteresis)

  # --- prediction -----------------------------------------------------------------------------

  def predict(self, setup: Setup, speeds, expected_steps: float) -> float:
    """Predicted seconds per step of `setup`, including its amortized switching cost and, for a
    resized setup, the learning it skips (see module doc)."""
    s = self.settings
    t = self.cost.compute_s(setup, speeds)
    if setup.keep is not None:
      kept = max(1.0 - self.cost.skipped_share(setup), 1e-6)
      t *= (1 + s.resize_penalty) / kept
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
    speeds = np.asarray(speeds, np.float64)
    self.account(step)
    self.step = step
    expected_steps = expected_s / max(step_s, 1e-9)
    cands = {"exact": self.setup.exact(),
             **self.policy.candidates(self, speeds, expected_steps)}
    pred = {name: self.predict(c, speeds, expected_steps) for name, c in cands.items()}
    now = self.predict(self.setup, speeds, expected_steps)
    slowest = int(np.argmin(speeds))
    context = (f"device {slowest} at speed {speeds[slowest]:.2f}, expected {expected_s:.1f} s "
               f"(~{expected_steps:.0f} steps) more")
    options = Options(step, cands, pred, self._current_name(), now, context, new_regime)
    choice, reason = self.policy.choose(self, options)
    new = cands.get(choice, self.setup)    # the same candidate may adjust its keep ratios
    moves = new.owned != self.setup.owned
    changed = new != self.setup
    if moves:
      reason = _drains(self.setup, new) + reason
      self.last_move_step = step
    if changed and self._streak[0] == choice:
      self._streak = (None, 0)
    self.setup = new
    return Decision(step, choice, new, changed, moves, reason, {"current": now, **pred},
                    tuple(float(x) for x in speeds), float(expected_s), self.skipped_steps)

  def choose_with_hysteresis(self, o: Options) -> tuple[str, str]:
    """(candidate, reason) under hysteresis, patience and dwell (see module doc)."""
    s = self.settings
    pred, cands, current, now = o.predicted, o.candidates, o.current, o.now
    best = min(pred, key=pred.get)
    if best == current:
      self._streak = (None, 0)
      return current, f"stay {current}: nothing predicted faster; {o.context}"
    gain = 1 - pred[best] / now
    moving = cands[best].owned != self.setup.owned
    if current == "resize" and best == "exact":     # stop resizing at once: it costs accuracy
      why = ("resizing no longer pays" if "resize" in cands else
             "resizing is beyond its horizon, exact is the fastest lossless option")
      return best, f"exact: {why} ({pred[best]:.4g} vs {now:.4g} s/step); {o.context}"
    # Resizing already waited for its patience; trading it for a lossless split needs none.
    from_resize = current == "resize" and best == "migrate"
    if gain < s.hysteresis and not from_resize:
      self._streak = (None, 0)      # patience counts consecutive wins: this decision is none
      why = f"{best} gains {gain:.1%} < hysteresis {s.hysteresis:.0%}"
    else:
      streak = self._streak[1] + 1 if self._streak[0] == best else 1
      self._streak = (best, streak)
      dwell = o.step - self.last_move_step
      if streak < s.patience and not from_resize and not o.new_regime:
        why = f"{best} wins {streak}/{s.patience} decisions"
      elif moving and dwell < s.min_dwell_steps:
        why = f"last migration {dwell} steps ago < {s.min_dwell_steps}"
      else:
        why = f"{gain:.1%} faster" if gain > 0 else f"{current} is no longer allowed"
        if o.new_regime and streak < s.patience:
          why += ", new regime: no patience"
        return best, (f"{best} predicted {pred[best]:.4g} s/step vs {now:.4g} now ({why}); "
                      f"{o.context}")
    # While waiting, take the best option that moves nothing (e.g. resize before migrating).
    still = {n: p for n, p in pred.items() if cands[n].owned == self.setup.owned}
    alt = min(still, key=still.get)
    if current not in cands:        # the current setup is no longer allowed (e.g. resize horizon)
      return alt, f"{alt}: {current} is no longer allowed (hold: {why}); {o.context}"
    if alt != current and alt != best and pred[alt] < now * (1 - s.hysteresis):
      return alt, f"{alt} meanwhile ({pred[alt]:.4g} s/step; hold: {why}); {o.context}"
    return current, f"stay {current} (hold: {why}); {o.context}"

  def _current_name(self) -> str:
    if self.setup.keep is not None:
      return "resize"
    if self.setup.offloaded:
      return "offload"
    return "exact"


def _drains(old: Setup, new: Setup) -> str:
  """"drain device 3; " / "restore device 3; ": devices a move leaves without units, or gives
  units again ("" if none)."""
  was, now = cost_lib.busy(old), cost_lib.busy(new)
  out = ""
  for word, devices in (("drain", was & ~now), ("restore", ~was & now)):
    if devices.any():
      ids = ", ".join(str(d) for d in np.flatnonzero(devices))
      out += f"{word} device{'s' if devices.sum() > 1 else ''} {ids}; "
  return out
