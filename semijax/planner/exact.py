"""Exact search of the plan space for small clusters, with its symmetries and a bound.

The plan space: every (data, pipe, tensor), every assignment of devices to mesh positions, every
layer partition, every microbatch size, schedule and sync mode; the unit split and the
microbatch split follow by the planner's rules (units proportional to the slowest replica at
each position; the microbatch split that is best, `split.split_value`, exact).

Three symmetries leave every predicted time unchanged, and the search visits one grid of each
orbit:
  * devices of one class (`Cluster.classes`: equal speed, memory and links) are
    interchangeable, so grids are enumerated over class labels (multiset permutations);
  * pipelines are interchangeable (the step takes the slowest, the rings and the units the
    set of replicas), so rows d of the grid may be permuted;
  * tensor positions are interchangeable when permuted alike in every pipeline and stage (a
    stage takes its slowest position, boundaries pair position t with t, rings join position
    t of every pipeline).
Seen as an R x N matrix whose entries are the stages' labels at (d, t), the last two permute
rows and columns. Every such matrix can be brought to one whose rows and whose columns are both
in lexicographic order (sorting the rows, then the columns, repeatedly never makes the
row-major sequence larger, so it stops at such a matrix), so the search enumerates only those.

Branch and bound: a grid is skipped when a lower bound on any of its plans
(`evaluate.lower_bound`) is no better than the best plan found (the hierarchical search's plan
seeds it).
"""

from __future__ import annotations

import math
from typing import Iterator

import numpy as np

from semijax.planner import evaluate
from semijax.planner import request as request_lib
from semijax.planner import split as split_lib


def canonical_label_grids(labels, shape) -> Iterator[np.ndarray]:
  """Label grids int [R, S, N] over the multiset `labels`, one or more per orbit of the
  symmetries (module doc): rows (pipelines) and columns (tensor positions) in lexicographic
  order, the entry at (d, t) being the tuple of its stages' labels."""
  r_, s_, n_ = shape
  kinds, counts = np.unique(np.asarray(labels), return_counts=True)
  rem = [int(c) for c in counts]
  kinds = [int(k) for k in kinds]
  entries: list[tuple[int, ...]] = []

  def tuples(depth: int, prefix: list) -> Iterator[tuple[int, ...]]:
    if depth == s_:
      yield tuple(prefix)
      return
    for i, k in enumerate(kinds):
      if rem[i]:
        rem[i] -= 1
        prefix.append(k)
        yield from tuples(depth + 1, prefix)
        prefix.pop()
        rem[i] += 1

  def fill(i: int, row_gt: bool, col_gt: tuple) -> Iterator[np.ndarray]:
    if i == r_ * n_:
      grid = np.asarray(entries, np.int64).reshape(r_, n_, s_)
      yield np.ascontiguousarray(grid.transpose(0, 2, 1))
      return
    d, t = divmod(i, n_)
    if t == 0:
      row_gt = d == 0
    for e in tuples(0, []):
      rgt, cgt = row_gt, col_gt
      if not rgt:
        above = entries[i - n_]
        if e < above:
          continue
        rgt = e > above
      if t > 0 and not cgt[t]:
        left = entries[i - 1]
        if e < left:
          continue
        if e > left:
          cgt = cgt[:t] + (True,) + cgt[t + 1:]
      entries.append(e)             # `tuples` holds e's labels out of `rem` while suspended
      yield from fill(i + 1, rgt, cgt)
      entries.pop()

  yield from fill(0, True, (True,) + (False,) * (n_ - 1))


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
      for mb in req.microbatch_sizes:
        m_ = req.global_batch // mb
        if m_ < shape[0]:
          continue
        gc = evaluate.GridCosts.of(grid, req.costs, req.cluster, req.tokens(mb))
        for sync in req.syncs:
          bound = evaluate.lower_bound(gc, req.costs, m_, sync == "sync")
          if best is not None and bound >= best.value:
            continue
          for sched in req.schedules:
            values = evaluate.assess(gc, req.costs, parts, sched, m_, sync)
            i = int(np.argmin(values))
            if np.isfinite(values[i]) and (best is None or values[i] < best.value):
              best = request_lib.Candidate(float(values[i]), grid, tuple(int(x) for x in parts[i]),
                                           mb, sched, sync)
  return best
