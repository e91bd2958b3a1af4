"""The planner's exact sub-solvers: unit splits, layer partitions and microbatch splits.

  proportional_counts  U units over devices of speeds v (each >= 1) minimizing max(count / v):
                       the same counts as `core.layout.proportional_counts` (its greedy: every
                       next unit to the device that finishes it soonest), in O(N log N) instead of
                       O(U log N), so a planner can split d_ff = 16,384 units thousands of times.
  stage_units          a stage's units: per kind, proportional to the slowest replica's device
                       at each tensor position.
  compositions         every layer partition (S counts >= 1 summing to L), for exact search.
  minmax_layers        the partition minimizing max_p layers_p x w_p (layers are identical, so
                       this is `proportional_counts` with speeds 1 / w_p: optimal by the same
                       exchange argument).
  split_value          the least time of the slowest pipeline over every split of M microbatches
  balance_split        (each pipeline >= 1), and the split (moves from the slowest pipeline to
                       the one that would finish one more soonest, until none helps). Exact
                       because a pipeline's time never falls when it takes one more microbatch:
                       gpipe's table for M + 1 runs, in an injective map of ticks, a superset of
                       each tick of M's; 1f1b's greedy decides every microbatch's ticks from the
                       earlier microbatches alone, so the table for M + 1 is M's plus entries.
                       Either way no tick's cost falls. So the best split's value is the larger
                       of the slowest single-microbatch time and the (M - R)-th smallest "one
                       more" time across pipelines.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from typing import Callable, Sequence

import numpy as np

from semijax.core import layout as layout_lib


def proportional_counts(num_units: int, speeds: Sequence[float]) -> tuple[int, ...]:
  """`core.layout.proportional_counts(num_units, speeds)` (minimum one unit each), fast.

  The greedy hands out the `num_units - N` smallest keys k / v_d (k >= 2, ties to the lower
  device) of all devices. Every key <= tau = (U - N) / sum(v) is among them (there are at most
  U - N such keys), so those are counted at once and the heap hands out the rest (< 2 N).
  """
  s = np.asarray(speeds, np.float64)
  n = len(s)
  if n < 1 or n > num_units or np.any(~np.isfinite(s)) or np.any(s <= 0):
    # The library's own checks and messages.
    return layout_lib.proportional_counts(num_units, speeds)
  extra = num_units - n
  tau = extra / s.sum() * (1.0 - 1e-9)
  counts = [1 + max(0, int(np.floor(tau * x)) - 1) for x in s]
  left = num_units - sum(counts)
  heap = [((c + 1) / x, d) for d, (c, x) in enumerate(zip(counts, s.tolist()))]
  heapq.heapify(heap)
  for _ in range(left):
    _, d = heapq.heappop(heap)
    counts[d] += 1
    heapq.heappush(heap, ((counts[d] + 1) / s[d], d))
  return tuple(counts)


@functools.lru_cache(maxsize=65536)
def _cached_counts(num_units: int, speeds: tuple[float, ...]) -> tuple[int, ...]:
  return proportional_counts(num_units, speeds)


def stage_units(num_units: dict, position_speeds: Sequence[float]) -> dict:
  """{kind: units per tensor position}, each kind split proportionally to `position_speeds`
  (float [N]: the slowest replica's device speed at each position)."""
  speeds = tuple(float(v) for v in position_speeds)
  return {k: _cached_counts(int(u), speeds) for k, u in num_units.items()}


def even_units(num_units: dict, tensor: int) -> dict:
  """{kind: the even split over `tensor` positions} (`core.layout.even_counts`)."""
  return {k: layout_lib.even_counts(int(u), tensor) for k, u in num_units.items()}


@functools.lru_cache(maxsize=256)
def compositions(total: int, parts: int) -> np.ndarray:
  """int [P, parts]: every way to write `total` as `parts` ordered counts >= 1."""
  if parts < 1 or total < parts:
    return np.zeros((0, max(parts, 0)), np.int64)
  rows = [np.diff((0,) + cuts + (total,))
          for cuts in itertools.combinations(range(1, total), parts - 1)]
  out = np.asarray(rows, np.int64).reshape(-1, parts)
  out.flags.writeable = False
  return out


def num_compositions(total: int, parts: int) -> int:
  """How many rows `compositions(total, parts)` has."""
  return math.comb(total - 1, parts - 1) if 1 <= parts <= total else 0


def even_layers(total: int, parts: int) -> tuple[int, ...]:
  """As equal as possible, the first stages one more (`core.layout.even_counts`)."""
  return layout_lib.even_counts(total, parts)


def minmax_layers(total: int, weights: Sequence[float]) -> tuple[int, ...]:
  """The layers per stage (each >= 1, summing to `total`) minimizing max_p layers_p * w_p, for
  w_p > 0 the time of one layer on stage p."""
  w = np.asarray(weights, np.float64)
  return proportional_counts(total, 1.0 / w)


def split_value(times: np.ndarray, total: int) -> np.ndarray:
  """The least slowest-pipeline time over every split of `total` microbatches (each >= 1).

  Args:
    times: float [..., R, K]: times[..., d, m - 1] the seconds of pipeline d with m
      microbatches, non-decreasing in m (inf where it does not fit), K >= total - R + 1.
    total: M.

  Returns:
    float [...] (inf where M < R or nothing fits).
  """
  times = np.asarray(times, np.float64)
  r_ = times.shape[-2]
  if total < r_:
    return np.full(times.shape[:-2], np.inf)
  first = times[..., 0].max(axis=-1)
  k = total - r_
  if k == 0:
    return first
  more = times[..., 1:].reshape(times.shape[:-2] + (-1,))
  kth = np.partition(more, k - 1, axis=-1)[..., k - 1]
  return np.maximum(first, kth)


def balance_split(time_of: Callable[[int, int], float], num_pipelines: int, total: int,
                  start: Sequence[int]) -> tuple[float, tuple[int, ...]]:
  """The split `split_value` prices, from a starting split, evaluating only the times it needs.

  While the slowest pipeline (one of them, if several tie) holds more than one microbatch and
  some other pipeline would finish one more sooner than the slowest finishes now, the
  microbatch moves. When no move is left the split is optimal: a split whose slowest pipeline
  is faster must take a microbatch from the current slowest and give one to another pipeline,
  which then takes at least as long as the current slowest (times never fall with more
  microbatches). A start near the optimum (e.g. by throughput) makes few moves.

  Args:
    time_of: time_of(d, m) the seconds of pipeline d with m microbatches (callers cache it).
    num_pipelines: R; total: M >= R.
    start: R counts >= 1 summing to M.

  Returns:
    (the slowest pipeline's seconds, microbatches per pipeline); (inf, ()) if M < R.
  """
  r_ = num_pipelines
  if total < r_:
    return np.inf, ()
  m = np.asarray(start, np.int64).copy()
  if len(m) != r_ or m.sum() != total or m.min() < 1:
    raise ValueError(f"start: need {r_} counts >= 1 summing to {total}, got {list(start)}")
  cur = np.array([time_of(d, int(m[d])) for d in range(r_)])
  nxt = np.array([time_of(d, int(m[d]) + 1) for d in range(r_)])
  while True:
    d = int(np.argmax(cur))
    if m[d] <= 1 or r_ == 1:
      break
    nxt_d, nxt[d] = nxt[d], np.inf
    e = int(np.argmin(nxt))
    nxt[d] = nxt_d
    if not nxt[e] < cur[d]:
      break
    m[d] -= 1
    m[e] += 1
    cur[d], nxt[d] = time_of(d, int(m[d])), cur[d]
    cur[e], nxt[e] = nxt[e], time_of(e, int(m[e]) + 1)
  return float(cur.max()), tuple(int(x) for x in m)
