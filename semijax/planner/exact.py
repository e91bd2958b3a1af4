"""Exact search of the plan space for small clusters, with its symmetries and a bound.

The plan space: every (data, pipe, tensor), every assignment of devices to mesh positions, every
layer partition, every microbatch size, schedule and sync mode; the unit split and the
microbatch split follow by the planner's rules (units proportional to the slowest replica at
each position; the microbatch split that is best, `split.split_value`, exact).

Two symmetries leave every predicted time unchanged, and the search visits one grid of each
orbit:
  * devices of one class (`Cluster.classes`: equal speed, memory and links) are
    interchangeable, so grids are enumerated over class labels (multiset permutations);
  * pipelines are interchangeable (the step takes the slowest, the rings and the units the
    set of replicas), so only grids whose pipelines (rows) are in lexicographic order are
    enumerated (every orbit has one: sort its rows).
Tensor positions are *not* interchangeable, although a stage takes its slowest position and
boundaries and rings pair position t with t: the unit split breaks ties between equally good
splits by position (`layout.proportional_counts` gives speeds (1, 0.5) 6 and 2 of 8 heads, but
(0.5, 1) 3 and 5), and the tie decides the other replicas' compute. So every position order is
searched.

Branch and bound: a grid is skipped when a lower bound on any of its plans
(`evaluate.lower_bound`) is no better than the best plan found (the hierarchical search's plan
seeds it).
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from semijax.planner import request as request_lib
from semijax.planner import split as split_lib


def canonical_label_grids(labels, shape) -> Iterator[np.ndarray]:
  """Label grids int [R, S, N] over the multiset `labels`, one or more per orbit of the
  symmetries (module doc): the pipelines (rows, each read in (stage, position) order) in
  lexicographic order."""
  r_, s_, n_ = shape
  kinds, counts = np.unique(np.asarray(labels), return_counts=True)
  rem = [int(c) for c in counts]
  kinds = [int(k) for k in kinds]
  cells: list[int] = []
  width = s_ * n_

  def fill(i: int, row_gt: bool) -> Iterator[np.ndarray]:
    if i == r_ * width:
      yield np.asarray(cells, np.int64).reshape(r_, s_, n_)
      return
    if i % width == 0:
      row_gt = i == 0
    for j, k in enumerate(kinds):
      if not rem[j]:
        continue
      gt = row_gt
      if not gt:
        above = cells[i - width]
        if k < above:
          continue
        gt = k > above
      rem[j] -= 1
      cells.append(k)
      yield from fill(i + 1, gt)
      cells.pop()
      rem[j] += 1

  yield from fill(0, True)


def device_grid(label_grid: np.ndarray, classes: np.ndarray) -> np.ndarray:
  """int [R, S, N] device ids: each class's devices in id order, placed in row-major order."""
  pools = {int(c): list(np.flatnonzero(classes == c)) for c in np.unique(classes)}
  out = np.empty(label_grid.size, np.int64)
  for i, c in enumerate(label_grid.reshape(-1)):
    out[i] = pools[int(c)].pop(0)
  return out.reshape(label_grid.shape)


def num_label_grids(classes: np.ndarray) -> int:
  """The multiset permutations of the class labels (an upper bound on the grids per mesh)."""
  _, counts = np.unique(classes, return_counts=True)
  return math.factorial(int(counts.sum())) // math.prod(math.factorial(int(c)) for c in counts)


def work(req: request_lib.Request) -> int:
  """An upper bound on the (grid, partition) pairs the exact search prices."""
  grids = num_label_grids(req.cluster.classes())
  return sum(grids * split_lib.num_compositions(req.costs.num_layers, pipe)
             for _, pipe, _ in req.factorizations())


def search(req: request_lib.Request,
           incumbent: request_lib.Candidate | None = None) -> request_lib.Candidate | None:
  """The best candidate over the whole plan space (None if no plan fits in memory)."""
  best = incumbent
  classes = req.cluster.classes()
  for shape in req.factorizations():
    parts = split_lib.compositions(req.costs.num_layers, shape[1])
    for labels in canonical_label_grids(classes, shape):
      grid = device_grid(labels, classes)
      for gc, mb, sync, bound in request_lib.bounded(req, grid, shape[0]):
        if best is not None and bound >= best.value:
          continue
        for sched in req.schedules:
          best = request_lib.better(best, request_lib.cheapest(req, gc, parts, mb, sched, sync))
  return best
