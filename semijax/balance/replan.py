"""Re-planning a pipelined run while it trains: the layers each stage holds and each stage's
units over its tensor devices, when the devices' speeds change (`balance.policy = "semi"` on a
pipelined run; `train.stage_balance` drives it).

The placement (the device at each mesh position), the microbatches of every pipeline and the
compiled shapes stay: every candidate fits the run's layer slots per stage and its units'
bucket (capacity and compute widths), so a re-plan compiles nothing but its migration
(`core.pipeline.PipelineEngine.move`).

Candidates, for speeds v [D] by device id:
  units   the current ones, or each stage's units of each kind in proportion to the slowest
          pipeline's device at each tensor position (`core.layout.proportional_counts`, at
          most the bucket's capacity), reached from the current owners by moving as few units
          as possible (`buckets.rebalance`); on a tie the current ones (rounded up to a
          compiled width, a proportional split may run no faster);
  layers  for each: from the current partition, the even one and the one in proportion to
          each stage's speed (one layer's time on its slowest device), one layer at a time
          between two stages (any two up to `ALL_PAIRS` stages) while the predicted step
          falls, every stage within its compiled slots.
Each is priced by the time model the emulation sleeps and the planner minimizes
(`core.emulation.PipelineEmulator.layout_step` at speeds v: the executed bucket widths, the
tensor all-reduces, boundary transfers and gradient all-reduces over the links).

Deciding (`Replanner.observe`, every `probe_every` steps): a `speed.SpeedTracker` over every
device turns samples into regimes (a change must last `confirm` samples). Two moves are
weighed: to the best candidate, and to the current layers with the proportional units (a
cheaper move when the best moves layers). One is taken when it is predicted at least
`hysteresis` faster than the current layout, at least `min_dwell_steps` after the last move,
and its gain over the steps the current speeds are expected to last (at most the steps left)
exceeds the move's expected cost (of the two, the larger gain net of cost): the state that
changes device over the mesh's slowest link, plus the overhead measured of moves of its kind
(`move_kind`: units only, or layers too, which moves every stage's units through the canonical
layout and back): warm-up times one of each there and back (`trials`; every migration program
is compiled by then, `core.pipeline_moves`), and each move made updates it.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np

from semijax.balance import buckets as buckets_lib
from semijax.balance import speed as speed_lib
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import pipeline_layout
from semijax.core import schedule as schedule_lib

PipeLayout = pipeline_layout.PipeLayout
# Parameter, first and second moment: the copies of every parameter a move carries.
STATE_COPIES = 3
# Layer moves tried per re-plan, at most; beyond this many stages a layer moves only to a
# neighbouring stage or off the busiest one (as the planner's search does).
MAX_MOVES = 64
ALL_PAIRS = 8


@dataclasses.dataclass(frozen=True)
class Proposal:
  """A re-plan: the layout to move to and what it is predicted to give.

  Attributes:
    layout: the new layout (same layer slots and unit bucket as the current one).
    now_s: the current layout's predicted step at the new speeds.
    new_s: the new layout's.
    move_s: the move's expected seconds (links and overhead).
    link_s: its links' part (what an emulation sleeps for it).
    horizon_steps: the steps its gain was counted over.
  """

  layout: PipeLayout
  now_s: float
  new_s: float
  move_s: float
  link_s: float
  horizon_steps: float


def move_kind(old: PipeLayout, new: PipeLayout) -> str:
  """"layers" for a move that changes the layers per stage (three migration phases), else
  "units" (one)."""
  return "layers" if old.layers != new.layers else "units"


def trials(layout: PipeLayout) -> dict[str, PipeLayout]:
  """A layout one small move of each kind away from `layout`, to time at warm-up: {"units":
  in every stage one unit of each kind from its largest to its smallest device
  (`buckets.shift_one`), "layers": one layer moved from a stage to another (the first of
  `neighbours`)}; a kind without room to move is left out."""
  out = {}
  units = [buckets_lib.rebalance(u, {k: buckets_lib.shift_one(x.counts, x.capacity)
                                     for k, x in u.kinds().items()}) for u in layout.units]
  if tuple(units) != layout.units:
    out["units"] = layout.with_units(units)
  near = neighbours(layout.stage_layers, layout.layers.capacity)
  if near:
    out["layers"] = with_layers(layout, near[0])
  return out


def stage_targets(layout: PipeLayout, grid: np.ndarray, speeds: np.ndarray) -> list[dict]:
  """Per stage {kind: counts [T]}: in proportion to the slowest pipeline's device at each
  tensor position, within the bucket's capacity (grid: int [R, S, T] device ids)."""
  out = []
  for p, units in enumerate(layout.units):
    position = speeds[grid[:, p, :]].min(axis=0)
    out.append({k: layout_lib.proportional_counts(u.num_units, position,
                                                  maximum=u.capacity)
                for k, u in units.kinds().items()})
  return out


def with_layers(layout: PipeLayout, counts: Sequence[int]) -> PipeLayout:
  """`layout`'s units with `counts` layers per stage in its slots."""
  cap = layout.layers.capacity
  return PipeLayout(layout_lib.UnitLayout.from_counts(pipeline_layout.LAYERS, tuple(counts),
                                                      capacity=cap, widths=(cap,)), layout.units)


def neighbours(counts: Sequence[int], capacity: int,
               weights: Sequence[float] | None = None) -> list[tuple[int, ...]]:
  """Partitions one layer away: a stage with two or more gives one to a stage with a free slot;
  any to any up to `ALL_PAIRS` stages, beyond to a neighbouring stage, and the busiest stage
  (largest layers x `weights`, one layer's time) to any."""
  s_ = len(counts)
  if s_ <= ALL_PAIRS:
    pairs = list(itertools.permutations(range(s_), 2))
  else:
    busiest = int(np.argmax(np.asarray(counts) * np.asarray(weights if weights is not None
                                                            else np.ones(s_))))
    pairs = sorted({(i, i + d) for i in range(s_) for d in (-1, 1) if 0 <= i + d < s_}
                   | {(busiest, j) for j in range(s_) if j != busiest})
  out = []
  for i, j in pairs:
    if counts[i] > 1 and counts[j] < capacity:
      x = list(counts)
      x[i] -= 1
      x[j] += 1
      out.append(tuple(x))
  return out


class Replanner:
  """Decides when a pipelined run's layout changes, and to what (see module doc).

  Args:
    emulator: the run's time model (speeds replaced by each sample's; links and grid kept).
    layout: the layout the run starts in.
    microbatches: [R] microbatches of each pipeline.
    total_steps: the run's steps (a gain counts over the steps left at most).
    hysteresis, min_dwell_steps, speed_alpha, change_threshold, confirm: `config.balance`'s.
  """

  def __init__(self, emulator: emulation.PipelineEmulator, layout: PipeLayout,
               microbatches: Sequence[int], total_steps: int, *, hysteresis: float = 0.05,
               min_dwell_steps: int = 5, speed_alpha: float = 0.3,
               change_threshold: float = 0.2, confirm: int = 2):
    self.emulator, self.layout = emulator, layout
    self.microbatches, self.total_steps = tuple(microbatches), int(total_steps)
    self.hysteresis, self.min_dwell_steps = float(hysteresis), int(min_dwell_steps)
    n = len(emulator.devices.speeds)
    self.tracker = speed_lib.SpeedTracker(n, alpha=speed_alpha, threshold=change_threshold,
                                          confirm=confirm, min_expected_s=1.0)
    self.last_move = -10**9
    self.overhead_s: dict[str, float] = {}   # {move_kind: measured seconds beyond its links}
    self.moves = 0
    self._best = None      # ((regime speeds, layout), the best candidate), until either changes

  def seconds(self, layout: PipeLayout, speeds) -> float:
    """The predicted seconds of a step of `layout` on devices of `speeds` [D]."""
    em = self.emulator.with_speeds(speeds)
    return em.layout_step(layout, self.microbatches)["step_s"]

  def best(self, speeds) -> tuple[PipeLayout, float]:
    """The fastest candidate at `speeds` [D] and its predicted step (see module doc): the
    layer search on the current units and on the proportional ones; on a tie the current units
    (a move that changes nothing costs time)."""
    speeds = np.asarray(speeds, np.float64)
    found = [self._best_layers(base, speeds)
             for base in (self.layout, self.units_moved(speeds))]
    return min(found, key=lambda f: f[1])

  def units_moved(self, speeds) -> PipeLayout:
    """The current layers with each stage's units in proportion to `speeds` [D] (the units
    candidate of the module doc), reached by moving as few units as possible."""
    current = self.layout
    targets = stage_targets(current, self.emulator.grid, np.asarray(speeds, np.float64))
    return current.with_units([buckets_lib.rebalance(u, t)
                               for u, t in zip(current.units, targets)])

  def _best_layers(self, base: PipeLayout, speeds: np.ndarray) -> tuple[PipeLayout, float]:
    """`base`'s units with the best layers per stage found from three starts (module doc)."""
    cap, num_layers = base.layers.capacity, base.layers.num_units
    per_layer = self._layer_seconds(base, speeds)
    starts = {self.layout.stage_layers, layout_lib.even_counts(num_layers, base.stages),
              layout_lib.proportional_counts(num_layers, 1.0 / per_layer, maximum=cap)}
    price = lambda counts: self.seconds(with_layers(base, counts), speeds)
    best_counts, best_s = None, np.inf
    for counts in sorted(starts):
      if max(counts) > cap:
        continue
      value = price(counts)
      for _ in range(MAX_MOVES):
        near = neighbours(counts, cap, per_layer)
        values = [price(c) for c in near]
        if not near or not min(values) < value:
          break
        i = int(np.argmin(values))
        counts, value = near[i], values[i]
      if value < best_s:
        best_counts, best_s = counts, value
    return with_layers(base, best_counts), float(best_s)

  def _layer_seconds(self, layout: PipeLayout, speeds: np.ndarray) -> np.ndarray:
    """float [S]: one layer's forward on each stage's slowest device (at its unit counts), the
    weights of the proportional layer split."""
    em = self.emulator
    out = np.zeros(layout.stages)
    for p, units in enumerate(layout.units):
      work = sum(em.unit_ms[k] * np.asarray(units.kinds()[k].active, np.float64)
                 for k in em.unit_ms)
      out[p] = float((work / speeds[em.grid[:, p, :]]).max())
    return np.maximum(out, 1e-12)

  def link_seconds(self, old: PipeLayout, new: PipeLayout) -> float:
    """The links' part of moving from `old` to `new`: on the device whose state changes most,
    its changed share of the layer slots and units (parameters and both moments), over the
    mesh's slowest link."""
    em = self.emulator
    stage_old = np.repeat(np.arange(old.stages), old.stage_layers)
    stage_new = np.repeat(np.arange(new.stages), new.stage_layers)
    layer_share = np.zeros(old.stages)
    for a, b in zip(stage_old, stage_new):
      if a != b:
        layer_share[[a, b]] += 1.0 / old.layers.capacity
    unit_share = np.zeros(old.stages)
    for p, (u, v) in enumerate(zip(old.units, new.units)):
      for k, x in u.kinds().items():
        y = v.kinds()[k]
        changed = sum(len(set(a) ^ set(b)) for a, b in zip(x.owned, y.owned))
        unit_share[p] = max(unit_share[p], changed / max(x.capacity, 1) / 2)
    share = float((np.minimum(layer_share + unit_share, 1.0)).max())
    if share == 0:
      return 0.0
    nbytes = STATE_COPIES * em.stack_bytes * share
    latency, bandwidth = em.devices.group_link(em.grid.reshape(-1))
    return schedule_lib.send_s(nbytes, latency, bandwidth)

  def observe(self, step: int, speeds, step_s: float, scale: float = 1.0) -> Proposal | None:
    """A sample of relative speeds [D] after 0-based `step` (whose measured seconds were
    `step_s`); returns the re-plan to make now, or None. `scale`: measured seconds per predicted
    second (the time model's steps are multiplied by it; links are not)."""
    speeds = np.asarray(speeds, np.float64)
    self.tracker.update(1.0 / speeds, float(step))
    if step - self.last_move < self.min_dwell_steps:
      return None
    current = self.tracker.speeds * speeds.max()    # the regime's, at the sample's scale
    key = (tuple(np.round(self.tracker.speeds, 3).tolist()), self.layout)
    if self._best is None or self._best[0] != key:
      found = {self.best(current)[0], self.units_moved(current)} - {self.layout}
      self._best = (key, sorted(found, key=lambda x: move_kind(self.layout, x)))
    if not self._best[1]:
      return None
    now_s = self.seconds(self.layout, current) * scale
    left = self.total_steps - step - 1
    horizon = min(float(left), self.tracker.expected_remaining_s(float(step)))
    paying = []
    for layout in self._best[1]:
      new_s = self.seconds(layout, current) * scale    # at this sample's scale, not the cached
      if not new_s < now_s * (1.0 - self.hysteresis):
        continue
      link_s = self.link_seconds(self.layout, layout)
      move_s = link_s + self.overhead_s.get(move_kind(self.layout, layout), step_s)
      if (now_s - new_s) * horizon > move_s:
        paying.append(Proposal(layout, now_s, new_s, move_s, link_s, horizon))
    return max(paying, key=lambda p: (p.now_s - p.new_s) * p.horizon_steps - p.move_s,
               default=None)

  def timed(self, kind: str, seconds: float) -> None:
    """Records that a move of `kind` (`move_kind`) took `seconds` beyond its links (the mean
    with the earlier ones, the latest weighing half)."""
    before = self.overhead_s.get(kind)
    self.overhead_s[kind] = seconds if before is None else 0.5 * (before + seconds)

  def moved(self, step: int, proposal: Proposal, seconds: float) -> None:
    """Records that the run moved to `proposal.layout` after `step`, in `seconds` (wall, its
    links' emulated time included)."""
    self.timed(move_kind(self.layout, proposal.layout), max(seconds - proposal.link_s, 0.0))
    self.layout, self.last_move, self.moves = proposal.layout, step, self.moves + 1
