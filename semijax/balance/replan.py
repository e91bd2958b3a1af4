"""Re-planning a pipelined run while it trains: the layers each stage holds, each stage's
units over its tensor devices, and the microbatches of each data-parallel pipeline, when the
devices' speeds change (`balance.policy = "semi"` on a pipelined run; `train.stage_balance`
drives it).

The placement (the device at each mesh position), the global batch and the compiled shapes
stay: every candidate fits the run's layer slots per stage, its units' bucket (capacity and
compute widths) and its microbatch slots per pipeline, so a re-plan compiles nothing but its
migration (`core.pipeline.PipelineEngine.move`), which warm-up compiles.

Candidates, for speeds v [D] by device id:
  units   the current ones, or each stage's units of each kind in proportion to the slowest
          pipeline's device at each tensor position (`core.layout.proportional_counts`, at
          most the bucket's capacity), reached from the current owners by moving as few units
          as possible (`buckets.rebalance`); on a tie the current ones (rounded up to a
          compiled width, a proportional split may run no faster);
  layers  for each: from the current partition, the even one and the one in proportion to
          each stage's speed (one layer's time on its slowest device), one layer at a time
          between two stages (any two up to `ALL_PAIRS` stages) while the predicted step
          falls, every stage within its compiled slots;
  split   for a layout, the microbatches per pipeline from the current, the even and the
          rate-proportional split, one microbatch at a time between two pipelines while the
          predicted step falls (`best_split`; with one pipeline, none).
Each is priced by the time model the emulation sleeps and the planner minimizes
(`core.emulation.PipelineEmulator.layout_step` at speeds v: the executed bucket widths, the
tensor all-reduces, boundary transfers and gradient all-reduces over the links).

Deciding (`Replanner.observe`, every `probe_every` steps): a `speed.SpeedTracker` over every
device turns samples into regimes (a change must last `confirm` samples). The moves weighed
(`candidates`): to the best layout, to the current layers with the proportional units (a
cheaper move when the best moves layers), and to the current layout, each with the current
split and with its best split. One is taken when it is predicted at least `hysteresis` faster
than the current plan, at least `min_dwell_steps` after the last move, and its gain over the
steps the current speeds are expected to last (at most the steps left) exceeds the move's
expected cost (of those, the largest gain net of cost): the state that changes device over the
mesh's slowest link, plus the overhead measured of moves of its kind (`move_kind`: units only,
or layers too, which moves every stage's units through the canonical layout and back; a new
split alone moves nothing): warm-up times one of each there and back (`trials`; every
migration program is compiled by then, `core.pipeline_moves`), and each move made updates it.
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
    microbatches: [R] the microbatches of each pipeline in it (the same total).
  """

  layout: PipeLayout
  now_s: float
  new_s: float
  move_s: float
  link_s: float
  horizon_steps: float
  microbatches: tuple[int, ...] = ()


def move_kind(old: PipeLayout, new: PipeLayout) -> str:
  """"layers" for a move that changes the layers per stage (three migration phases), "units"
  for one of units only (one phase), "split" for none (only the microbatches per pipeline
  change: nothing moves)."""
  if old.layers != new.layers:
    return "layers"
  return "units" if old != new else "split"


def climb(starts, price, near) -> tuple[tuple[int, ...], float]:
  """(counts, price): the lowest `price(counts)` reached from each of `starts` by single steps to
  `near(counts)` while the price falls (at most `MAX_MOVES` steps each); on a tie the first
  start in sorted order."""
  best_counts, best_s = None, np.inf
  for counts in sorted(starts):
    value = price(counts)
    for _ in range(MAX_MOVES):
      nearby = near(counts)
      values = [price(c) for c in nearby]
      if not nearby or not min(values) < value:
        break
      i = int(np.argmin(values))
      counts, value = nearby[i], values[i]
    if value < best_s:
      best_counts, best_s = counts, value
  return best_counts, float(best_s)


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
  """Partitions one layer (or microbatch) away: a stage (or pipeline) with two or more gives
  one to one with a free slot; any to any up to `ALL_PAIRS` of them, beyond to a neighbour, and
  the busiest (largest counts x `weights`, the time of one) to any."""
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
    microbatches: [R] microbatches of each pipeline at the start.
    total_steps: the run's steps (a gain counts over the steps left at most).
    most: the microbatches a pipeline may run (compiled; default the most at the start).
    hysteresis, min_dwell_steps, speed_alpha, change_threshold, confirm: `config.balance`'s.
  """

  def __init__(self, emulator: emulation.PipelineEmulator, layout: PipeLayout,
               microbatches: Sequence[int], total_steps: int, *, hysteresis: float = 0.05,
               min_dwell_steps: int = 5, speed_alpha: float = 0.3,
               change_threshold: float = 0.2, confirm: int = 2, most: int = 0):
    self.emulator, self.layout = emulator, layout
    self.microbatches, self.total_steps = tuple(microbatches), int(total_steps)
    self.most = int(most) or max(self.microbatches)
    self.hysteresis, self.min_dwell_steps = float(hysteresis), int(min_dwell_steps)
    n = len(emulator.devices.speeds)
    self.tracker = speed_lib.SpeedTracker(n, alpha=speed_alpha, threshold=change_threshold,
                                          confirm=confirm, min_expected_s=1.0)
    self.last_move = -10**9
    self.overhead_s: dict[str, float] = {}   # {move_kind: measured seconds beyond its links}
    self.moves = 0
    self._best = None      # ((regime speeds, layout, split), the candidates), until one changes

  def seconds(self, layout: PipeLayout, speeds, microbatches=None) -> float:
    """The predicted seconds of a step of `layout` on devices of `speeds` [D], with
    `microbatches` [R] per pipeline (default the current ones)."""
    em = self.emulator.with_speeds(speeds)
    return em.layout_step(layout, microbatches or self.microbatches)["step_s"]

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

  def best_split(self, layout: PipeLayout, speeds) -> tuple[tuple[int, ...], float]:
    """The microbatches per pipeline [R] that make `layout` fastest at `speeds` [D] (the same
    total, each between 1 and `most`), and that step: from the current split, the even one and
    the one in proportion to each pipeline's rate, one microbatch at a time between two
    pipelines while the predicted step falls."""
    current, most = self.microbatches, self.most
    if len(current) == 1:
      return current, self.seconds(layout, speeds)
    em = self.emulator.with_speeds(np.asarray(speeds, np.float64))
    per = np.asarray(em.layout_step(layout, current)["pipeline_s"]) / np.asarray(current)
    total = sum(current)
    starts = {current, layout_lib.proportional_counts(total, 1.0 / per, maximum=most)}
    even = layout_lib.even_counts(total, len(current))
    if max(even) <= most:
      starts.add(even)
    return climb(starts, lambda c: self.seconds(layout, speeds, c),
                 lambda c: neighbours(c, most, per))

  def _best_layers(self, base: PipeLayout, speeds: np.ndarray) -> tuple[PipeLayout, float]:
    """`base`'s units with the best layers per stage found from three starts (module doc)."""
    cap, num_layers = base.layers.capacity, base.layers.num_units
    per_layer = self._layer_seconds(base, speeds)
    starts = {self.layout.stage_layers, layout_lib.even_counts(num_layers, base.stages),
              layout_lib.proportional_counts(num_layers, 1.0 / per_layer, maximum=cap)}
    counts, seconds = climb({c for c in starts if max(c) <= cap},
                            lambda c: self.seconds(with_layers(base, c), speeds),
                            lambda c: neighbours(c, cap, per_layer))
    return with_layers(base, counts), seconds

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
    key = (tuple(np.round(self.tracker.speeds, 3).tolist()), self.layout, self.microbatches)
    if self._best is None or self._best[0] != key:
      self._best = (key, self.candidates(current))
    if not self._best[1]:
      return None
    now_s = self.seconds(self.layout, current) * scale
    left = self.total_steps - step - 1
    horizon = min(float(left), self.tracker.expected_remaining_s(float(step)))
    paying = []
    for layout, split in self._best[1]:
      new_s = self.seconds(layout, current, split) * scale   # at this sample's scale
      if not new_s < now_s * (1.0 - self.hysteresis):
        continue
      link_s = self.link_seconds(self.layout, layout)
      kind = move_kind(self.layout, layout)
      move_s = link_s + self.overhead_s.get(kind, 0.0 if kind == "split" else step_s)
      if (now_s - new_s) * horizon > move_s:
        paying.append(Proposal(layout, now_s, new_s, move_s, link_s, horizon, split))
    return max(paying, key=lambda p: (p.now_s - p.new_s) * p.horizon_steps - p.move_s,
               default=None)

  def candidates(self, speeds) -> list[tuple[PipeLayout, tuple[int, ...]]]:
    """The (layout, microbatches [R]) weighed at `speeds` [D] (module doc): the best layout
    and the proportional units on the current layers, and the current layout, each with the
    current microbatches and with the best split for it; the current plan left out."""
    found = []
    for layout in (self.best(speeds)[0], self.units_moved(speeds), self.layout):
      for split in (self.microbatches, self.best_split(layout, speeds)[0]):
        if (layout, split) not in found + [(self.layout, self.microbatches)]:
          found.append((layout, split))
    return found

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
    self.microbatches = proposal.microbatches or self.microbatches
