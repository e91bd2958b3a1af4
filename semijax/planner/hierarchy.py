"""The planner's search for clusters too large to enumerate: placements built from regions and
device classes, layer partitions improved by local search.

For every (data, pipe, tensor) the devices are laid out along a path through the regions (the
order of regions whose consecutive links are fastest, exhaustively for up to 7 regions), each
region's devices fastest first, and cut into mesh positions in two ways:

  striped   pipelines are dealt like cards: pipeline d takes devices d, d + R, d + 2R, ... of
            the path, so every pipeline holds the same mix of classes and position (p, t) holds
            near-identical devices in every pipeline (the shared unit split wastes nothing,
            and each data-parallel ring stays inside one class and region); pipelines cross
            regions at stage boundaries, which carry activations only.
  blocked   pipeline d takes the path's d-th block of pipe x tensor devices, so pipelines stay
            inside regions and the data-parallel rings cross them.

In both, a pipeline's devices are cut in path order into stages of `tensor` consecutive devices
(tensor groups inside a region wherever the counts allow: the fastest links carry the most
frequent traffic); each layout is also tried with its stage order reversed. The layer
partition starts from the min-max partition for the slowest replica of each stage
(`split.minmax_layers`) and from the even one; the best few candidates over every mesh,
layout, microbatch size, schedule and sync mode are then improved by moving one layer at a time
between stages while the predicted step falls (between any two stages for up to 6 stages,
else between neighbours and from the busiest stage). Units and microbatch splits follow the
planner's exact rules.

Devices may be left idle. The search above runs first on every device, then on the devices left
after taking out the slowest (`device_sets`: devices of equal speed and memory leave together,
the slowest first), laid along the same path less those devices, with the best plan so far to
beat. A set is searched only if a `glance` at it (one entry of each of its `REFINED` most
promising meshes) already finds a faster plan, and `PATIENCE` sets in a row that find none end
the search: a failing device (a small fraction of the others' speed, or too little memory) is
left out at the cost of about one more search, while where every device helps the glances cost
little. Nothing here is exhaustive: on clusters small enough, `exact.search`
improves on it (seeded with its result).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Iterator

import numpy as np

from semijax.planner import cluster as cluster_lib
from semijax.planner import evaluate
from semijax.planner import request as request_lib
from semijax.planner import split as split_lib

# Regions up to this many are ordered along the path exhaustively, more greedily.
EXHAUSTIVE_REGIONS = 7
# How many of the best starting candidates get the layer local search.
REFINED = 6
# Rounds of the layer local search (each moves one layer).
MAX_MOVES = 64
# Up to this many stages the local search tries every move of a layer between two stages.
ALL_PAIRS = 6
# The search stops leaving out more devices after this many sets in a row that found nothing
# faster.
PATIENCE = 2


def region_path(cluster: cluster_lib.Cluster, nbytes: float) -> list[int]:
  """The regions in the order whose consecutive links move `nbytes` fastest in total."""
  regions = sorted(set(cluster.regions.tolist()))
  if len(regions) == 1:
    return regions
  rep = {r: int(np.flatnonzero(cluster.regions == r)[0]) for r in regions}
  cost = {(a, b): cluster.latency_s[rep[a], rep[b]] + nbytes / cluster.bandwidth[rep[a], rep[b]]
          for a in regions for b in regions if a != b}

  def length(path):
    return sum(cost[(a, b)] for a, b in zip(path, path[1:]))

  if len(regions) <= EXHAUSTIVE_REGIONS:
    return list(min(itertools.permutations(regions), key=length))
  paths = []
  for first in regions:
    path, left = [first], set(regions) - {first}
    while left:
      path.append(min(left, key=lambda b: cost[(path[-1], b)]))
      left.remove(path[-1])
    paths.append(path)
  return min(paths, key=length)


def device_path(cluster: cluster_lib.Cluster, nbytes: float) -> np.ndarray:
  """int [D]: devices region by region along `region_path`, each region's fastest first."""
  out = []
  for r in region_path(cluster, nbytes):
    ids = np.flatnonzero(cluster.regions == r)
    key = np.lexsort((ids, cluster.classes()[ids], -cluster.memory[ids], -cluster.speeds[ids]))
    out.append(ids[key])
  return np.concatenate(out)


def layouts(path: np.ndarray, shape) -> list[np.ndarray]:
  """The grids [R, S, N] of the module doc (striped, blocked, each also reversed), distinct."""
  r_, s_, n_ = shape
  striped = path.reshape(s_ * n_, r_).T.reshape(r_, s_, n_)
  blocked = path.reshape(r_, s_, n_)
  out = []
  for g in (striped, blocked, striped[:, ::-1], blocked[:, ::-1]):
    if not any(np.array_equal(g, h) for h in out):
      out.append(np.ascontiguousarray(g))
  return out


def starting_layers(gc: evaluate.GridCosts, num_layers: int) -> np.ndarray:
  """int [P, S]: the min-max partition for each stage's slowest replica, and the even one."""
  s_ = gc.grid.shape[1]
  w = (4.0 * gc.compute_s + 6.0 * gc.allreduce_s).max(axis=0)
  rows = [split_lib.even_layers(num_layers, s_)]
  if np.all(w > 0):
    rows.insert(0, split_lib.minmax_layers(num_layers, w))
  return np.unique(np.asarray(rows, np.int64), axis=0)


def neighbours(layers: np.ndarray, weights: np.ndarray) -> np.ndarray:
  """int [P, S]: partitions one layer away: any stage gives a layer to any other when there are
  at most `ALL_PAIRS` stages; beyond, a stage gives one to a neighbouring stage, or the busiest
  stage (largest layers x `weights`, one layer's time) to any other."""
  s_ = len(layers)
  if s_ <= ALL_PAIRS:
    pairs = itertools.permutations(range(s_), 2)
  else:
    busiest = int(np.argmax(layers * weights))
    pairs = {(i, i + d) for i in range(s_) for d in (-1, 1) if 0 <= i + d < s_}
    pairs |= {(busiest, j) for j in range(s_) if j != busiest}
    pairs = sorted(pairs)
  out = []
  for i, j in pairs:
    if layers[i] > 1:
      x = layers.copy()
      x[i] -= 1
      x[j] += 1
      out.append(x)
  return np.asarray(out, np.int64).reshape(-1, s_)


def improve(gc: evaluate.GridCosts, req: request_lib.Request, cand: request_lib.Candidate):
  """`cand` after moving one layer at a time while the predicted step falls."""
  m_ = req.global_batch // cand.microbatch_size
  layers, value = np.asarray(cand.layers, np.int64), cand.value
  weights = (4.0 * gc.compute_s + 6.0 * gc.allreduce_s).max(axis=0)
  for _ in range(MAX_MOVES):
    near = neighbours(layers, weights)
    if not len(near):
      break
    values = evaluate.assess(gc, req.costs, near, cand.schedule, m_, cand.sync)
    i = int(np.argmin(values))
    if not values[i] < value:
      break
    layers, value = near[i], float(values[i])
  return request_lib.Candidate(value, cand.grid, tuple(int(x) for x in layers),
                               cand.microbatch_size, cand.schedule, cand.sync)


def device_sets(cluster: cluster_lib.Cluster) -> Iterator[np.ndarray]:
  """int [k] device ids: every device, then without the slowest: the devices of equal speed and
  memory leave together, the slowest (then those with the least memory) first, until one such
  group is left."""
  _, kind = np.unique(np.stack([cluster.speeds, cluster.memory], axis=1), axis=0,
                      return_inverse=True)
  kind = kind.reshape(-1)
  for j in range(int(kind.max()) + 1):
    yield np.flatnonzero(kind >= j)


def starts(req: request_lib.Request, path: np.ndarray,
           limit: float = np.inf) -> list[tuple[evaluate.GridCosts, request_lib.Candidate]]:
  """The `REFINED` best starting (grid costs, candidate) pairs, fastest first, on the devices of
  `path`, laid out along it, among those whose bound is under `limit`.

  Best first: meshes by `Request.mesh_bounds`, each opened into its (layout, microbatch size,
  sync mode) entries, bounded by `evaluate.lower_bound`, when it comes first; entries priced
  (from `starting_layers`) in order of their bound, until the bound reaches `limit` or the
  `REFINED`-th best start."""
  tie = itertools.count()
  queue = [(bound, next(tie), shape, None) for shape, bound in req.mesh_bounds(path).items()]
  heapq.heapify(queue)
  found = []
  while queue:
    bound, _, shape, entry = heapq.heappop(queue)
    if bound >= limit or (len(found) >= REFINED and bound >= found[REFINED - 1][0]):
      break
    if entry is None:
      for grid in layouts(path, shape):
        for gc, mb, sync, grid_bound in request_lib.bounded(req, grid, shape[0]):
          heapq.heappush(queue, (grid_bound, next(tie), shape, (gc, mb, sync)))
      continue
    for cand in priced(req, *entry):
      found.append((cand.value, len(found), entry[0], cand))
    found.sort(key=lambda x: x[:2])
  return [(gc, cand) for _, _, gc, cand in found[:REFINED]]


def priced(req: request_lib.Request, gc: evaluate.GridCosts, microbatch_size: int,
           sync: str) -> list[request_lib.Candidate]:
  """The cheapest `starting_layers` candidate of an entry under each schedule (those that fit)."""
  parts = starting_layers(gc, req.costs.num_layers)
  out = [request_lib.cheapest(req, gc, parts, microbatch_size, sched, sync)
         for sched in req.schedules]
  return [c for c in out if c is not None]


def glance(req: request_lib.Request, path: np.ndarray, limit: float) -> bool:
  """Whether a quick look finds a plan on the devices of `path` faster than `limit`: of the
  `REFINED` meshes of least bound (`Request.mesh_bounds`), each one's entry of least bound,
  priced from `starting_layers`."""
  meshes = sorted((bound, i, shape) for i, (shape, bound) in
                  enumerate(req.mesh_bounds(path).items()) if bound < limit)
  for _, _, shape in meshes[:REFINED]:
    entries = [(bound, i, (gc, mb, sync)) for grid in layouts(path, shape)
               for i, (gc, mb, sync, bound) in enumerate(request_lib.bounded(req, grid, shape[0]))]
    bound, _, entry = min(entries, key=lambda x: x[:2])
    if bound < limit and any(c.value < limit for c in priced(req, *entry)):
      return True
  return False


def search_path(req: request_lib.Request, path: np.ndarray,
                incumbent: request_lib.Candidate | None = None) -> request_lib.Candidate | None:
  """The best candidate on the devices of `path` (the others idle), laid out along it, if it
  beats `incumbent` (else None; None too if none fits in memory): the best `starts` (none whose
  bound cannot beat `incumbent`), improved by `improve`."""
  best = None
  limit = np.inf if incumbent is None else incumbent.value
  for gc, cand in starts(req, path, limit):
    best = request_lib.better(best, improve(gc, req, cand) if gc.grid.shape[1] > 1 else cand)
  return best if best is not None and best.value < limit else None


def search(req: request_lib.Request) -> request_lib.Candidate | None:
  """The best candidate of the module doc's search (None if no plan fits in memory).

  The devices are those of `device_sets` in turn, the rest idle. After the first, a set is
  searched (`search_path`, with the best so far to beat) only if a `glance` at it finds a
  faster plan; `PATIENCE` sets in a row that find none end the search."""
  path = device_path(req.cluster, req.costs.activation_bytes(req.tokens(
      req.microbatch_sizes[0])))
  best, misses = None, 0
  for devices in device_sets(req.cluster):
    used = path[np.isin(path, devices)]
    found = None
    if best is None or glance(req, used, best.value):
      found = search_path(req, used, best)
    misses = 0 if found is not None else misses + 1
    best = found or best
    if best is not None and misses == PATIENCE:
      break
  return best
