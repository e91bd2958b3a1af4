"""Exact search of the plan space for small clusters, with its symmetries and a bound.

The plan space: every choice of devices to use (the others idle), every (data, pipe, tensor) of
them, every assignment of them to mesh positions, every layer partition, every microbatch size,
schedule and sync mode; the unit split and the microbatch split follow by the planner's rules
(units proportional to the slowest replica at each position; the microbatch split that is best,
`split.split_value`, exact).

Two symmetries leave every predicted time unchanged, and the search visits one grid of each
orbit:
  * devices of one class (`Cluster.classes`: equal speed, memory and links) are
    interchangeable, so a choice of devices is how many of each class are used (`label_sets`),
    and grids are enumerated over class labels (multiset permutations);
  * pipelines are interchangeable (the step takes the slowest, the rings and the units the
    set of replicas), so only grids whose pipelines (rows) are in lexicographic order are
    enumerated (every orbit has one: sort its rows).
Tensor positions are *not* interchangeable, although a stage takes its slowest position and
boundaries and rings pair position t with t: the unit split breaks ties between equally good
splits by position (`layout.proportional_counts` gives speeds (1, 0.5) 6 and 2 of 8 heads, but
(0.5, 1) 3 and 5), and the tie decides the other replicas' compute. So every position order is
searched.

Branch and bound: a mesh on a choice of devices is skipped when a lower bound on any of its grids
(`Request.mesh_bounds`) is no better than the best plan found, and a grid when a lower bound on
any of its plans (`evaluate.lower_bound`) is (the hierarchical search's plan seeds the best).
"""

from __future__ import annotations

import itertools
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


def num_label_sequences(classes: np.ndarray) -> np.ndarray:
  """float [D + 1]: entry k counts the distinct sequences of k labels drawn from the multiset
  `classes` (the label grids of every mesh of k devices, before symmetries), to float
  precision, inf past its range: k! [x^k] prod over classes of sum_{i <= count} x^i / i!,
  multiplied out in logarithms."""
  log_coef = np.zeros(1)
  for count in np.unique(classes, return_counts=True)[1]:
    out = np.full(log_coef.size + int(count), -np.inf)
    for i in range(int(count) + 1):
      window = slice(i, i + log_coef.size)
      out[window] = np.logaddexp(out[window], log_coef - math.lgamma(i + 1))
    log_coef = out
  log_k = np.array([math.lgamma(k + 1) for k in range(log_coef.size)])
  with np.errstate(over="ignore"):
    return np.rint(np.exp(log_coef + log_k))


def label_sets(classes: np.ndarray) -> Iterator[np.ndarray]:
  """The class labels (sorted) of every non-empty choice of devices to use, up to
  interchangeable devices: any number of each class (the rest idle), all of them first."""
  kinds, counts = np.unique(classes, return_counts=True)
  for used in itertools.product(*(range(int(c), -1, -1) for c in counts)):
    if any(used):
      yield np.repeat(kinds, used)


def work(req: request_lib.Request) -> float:
  """An upper bound on the (grid, partition) pairs the exact search prices: over every number
  of devices in use, the label sequences times the layer partitions of each mesh."""
  sequences = num_label_sequences(req.cluster.classes())
  total = 0.0
  for k in range(req.num_devices, 0, -1):
    total += sequences[k] * sum(split_lib.num_compositions(req.costs.num_layers, pipe)
                                for _, pipe, _ in req.factorizations(k))
    if math.isinf(total):
      break
  return total


def search_mesh(req: request_lib.Request, labels: np.ndarray, shape,
                best: request_lib.Candidate | None) -> request_lib.Candidate | None:
  """`best`, or the best candidate faster than it over every grid of mesh `shape` on the
  devices of class `labels` (one grid per orbit, skipped where its bound cannot beat `best`)."""
  classes = req.cluster.classes()
  parts = split_lib.compositions(req.costs.num_layers, shape[1])
  for grid_labels in canonical_label_grids(labels, shape):
    grid = device_grid(grid_labels, classes)
    for gc, mb, sync, bound in request_lib.bounded(req, grid, shape[0]):
      if best is not None and bound >= best.value:
        continue
      for sched in req.schedules:
        best = request_lib.better(best, request_lib.cheapest(req, gc, parts, mb, sched, sync))
  return best


def search(req: request_lib.Request,
           incumbent: request_lib.Candidate | None = None) -> request_lib.Candidate | None:
  """The best candidate over the whole plan space (None if no plan fits in memory): every
  choice of devices to use (`label_sets`), every mesh of them (skipped where its
  `Request.mesh_bounds` cannot beat the best plan found), every grid (`search_mesh`)."""
  best = incumbent
  classes = req.cluster.classes()
  for labels in label_sets(classes):
    for shape, mesh_bound in req.mesh_bounds(device_grid(labels, classes)).items():
      if best is None or mesh_bound < best.value:
        best = search_mesh(req, labels, shape, best)
  return best
