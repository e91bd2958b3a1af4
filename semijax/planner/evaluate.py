"""The time model of `predict`, vectorized for the search: one device grid, many layer partitions.

`GridCosts.of` computes what a placement fixes, whatever the layer partition: per pipeline d and
stage p the forward compute of one layer (`compute_s` [R, S]: the slowest tensor device's
share) and of the unsplit embedding or head (`edge_s` [R, S]), one tensor all-reduce
(`allreduce_s` [R, S]), the boundary transfer to the next stage (`send_s` [R, S-1]), and per
mesh position the data-parallel ring's link and the device's memory. `assess` then prices a
batch of partitions [P, S] under one schedule and sync mode, and `pipeline_seconds` one
pipeline at a time (for splits too long to tabulate). The formulas are
`predict`'s, which stays loop-by-loop and readable; the tests hold the two equal.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from semijax.core import schedule as schedule_lib
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import split as split_lib
from semijax.sync import predict as sync_predict

# Splits of up to this many microbatches per pipeline are priced from a table of every count
# (vectorized over partitions); longer ones one partition at a time (`best_split`).
TABLE_LIMIT = 32
# Beyond its stash (in_flight microbatches), a stage holds two activation buffers: the ppermute
# receive buffers of the forward input and of the incoming cotangent.
STASH_BUFFERS = 2


@functools.lru_cache(maxsize=1024)
def tick_masks(schedule: str, num_stages: int, num_microbatches: int):
  """(forward bool [T, S], backward bool [T, S], in_flight int [S]) of a schedule's table."""
  tab = schedule_lib.table(schedule, num_stages, num_microbatches)
  fwd = tab[..., 0] >= 0
  bwd = tab[..., 1] >= 0
  for x in (fwd, bwd):
    x.flags.writeable = False
  return fwd, bwd, schedule_lib.in_flight(tab)


def masked_step_time(masks, f, b, send):
  """`schedule.step_time` from `tick_masks` (send_f = send_b = send), batched over [...]."""
  fwd, bwd, _ = masks
  compute = (fwd * f[..., None, :] + bwd * b[..., None, :]).max(axis=-1)     # [..., T]
  if f.shape[-1] > 1:
    sends = np.maximum(fwd[:, :-1] * send[..., None, :], bwd[:, 1:] * send[..., None, :])
    compute = compute + sends.max(axis=-1)
  return compute.sum(axis=-1)


def _pair_link(cluster: cluster_lib.Cluster, members: np.ndarray):
  """(max latency, min bandwidth) over the pairs of each row of `members` [..., n] (the slowest
  link of a group or ring, `Cluster.group_link`); from the class-level links where there are
  fewer classes than members."""
  n = members.shape[-1]
  if n < 2:
    shape = members.shape[:-1]
    return np.zeros(shape), np.full(shape, np.inf)
  classes = cluster.classes()
  k = int(classes.max()) + 1
  if k < n:
    counts = (classes[members][..., None] == np.arange(k)).sum(axis=-2)      # [..., K]
    present = counts > 0
    pair = present[..., :, None] & present[..., None, :]
    pair &= ~np.eye(k, dtype=bool) | (counts >= 2)[..., :, None]
    lat, bw = cluster.class_links()
  else:
    lat = cluster.latency_s[members[..., :, None], members[..., None, :]]
    bw = cluster.bandwidth[members[..., :, None], members[..., None, :]]
    pair = ~np.eye(n, dtype=bool)
  return (np.where(pair, lat, -np.inf).max(axis=(-1, -2)),
          np.where(pair, bw, np.inf).min(axis=(-1, -2)))


@dataclasses.dataclass(frozen=True, eq=False)
class GridCosts:
  """What a placement fixes (see module doc). Shapes: R pipelines, S stages, N tensor positions.

  Attributes:
    grid: int [R, S, N] device ids.
    units: per stage {kind: counts [N]}.
    compute_s: float [R, S] one layer's forward compute for one microbatch.
    edge_s: float [R, S] the embedding's (first stage) and head's (last stage) forward compute
      for one microbatch on the group's slowest device.
    allreduce_s: float [R, S] one tensor all-reduce of one microbatch's activations.
    send_s: float [R, S-1] one microbatch over boundary p -> p+1 (and back).
    layer_params: parameters every device holds per layer slot: the units of each kind at the
      grid's capacity (the most any position holds) and the per-layer norms and biases.
    shared_params: the replicated parameters (embedding, final norm, head).
    pipe_allreduce_s: the slowest all-reduce of their gradients over a pipeline's stages.
    ring_latency_s, ring_bandwidth: float [S, N] the data-parallel ring's slowest link.
    memory: float [R, S, N] each position's device memory.
    act_bytes: bytes of one microbatch's activations (compute dtype).
    grad_bytes: bytes of one parameter's gradient (what the gradient all-reduces carry).
    state_bytes: bytes a device holds per parameter (the parameter and Adam's two moments,
      `costs.StateBytes.state`).
    type_first, type_of: pipelines with equal costs and memory are one type: int [types] the
      first pipeline of each type, int [R] each pipeline's type.
  """

  grid: np.ndarray
  units: tuple
  compute_s: np.ndarray
  edge_s: np.ndarray
  allreduce_s: np.ndarray
  send_s: np.ndarray
  layer_params: float
  shared_params: float
  pipe_allreduce_s: float
  ring_latency_s: np.ndarray
  ring_bandwidth: np.ndarray
  memory: np.ndarray
  act_bytes: float
  grad_bytes: float
  state_bytes: float
  type_first: np.ndarray
  type_of: np.ndarray

  @classmethod
  def of(cls, grid: np.ndarray, costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster,
         tokens: int, units=None) -> "GridCosts":
    """The costs of `grid` for microbatches of `tokens` tokens; `units` per stage (default:
    proportional to the slowest replica's device at each position, `split.stage_units`)."""
    grid = np.asarray(grid, np.int64)
    r_, s_, n_ = grid.shape
    speeds = cluster.speeds[grid]                                          # [R, S, N]
    if units is None:
      slowest = speeds.min(axis=0)
      units = tuple(split_lib.stage_units(costs.num_units, slowest[p]) for p in range(s_))
    unit_s = costs.unit_s(tokens)
    work = np.zeros((s_, n_))
    for p, u in enumerate(units):
      for k, counts in u.items():
        work[p] += unit_s[k] * np.asarray(counts, np.float64)
    layer_params = costs.layer_params + sum(
        costs.unit_params[k] * max(max(u[k]) for u in units) for k in costs.kinds)
    shared = costs.first_params + costs.last_params
    pipe_lat, pipe_bw = _pair_link(cluster, np.moveaxis(grid, 1, -1))     # [R, N]
    pipe_ar = float(np.max(np.zeros(pipe_lat.shape) + schedule_lib.allreduce_s(
        costs.nbytes.grad * shared, s_, pipe_lat, pipe_bw)))
    compute = (work[None] / speeds).max(axis=-1)                           # [R, S]
    edge = costs.edge_s(tokens, s_)[None, :] / speeds.min(axis=-1)         # [R, S]
    act = costs.activation_bytes(tokens)
    lat, bw = _pair_link(cluster, grid)                                    # [R, S]
    ar = np.zeros((r_, s_)) + schedule_lib.allreduce_s(act, n_, lat, bw)
    if s_ > 1:
      a, b = grid[:, :-1], grid[:, 1:]
      send = (cluster.latency_s[a, b] + act / cluster.bandwidth[a, b]).max(axis=-1)
    else:
      send = np.zeros((r_, 0))
    ring_lat, ring_bw = _pair_link(cluster, np.moveaxis(grid, 0, -1))     # [S, N]
    memory = cluster.memory[grid]
    sig = np.concatenate([compute, edge, ar, send, memory.reshape(r_, -1)], axis=1)
    _, first, inverse = np.unique(sig, axis=0, return_index=True, return_inverse=True)
    return cls(grid, tuple(units), compute, edge, ar, send, float(layer_params), float(shared),
               pipe_ar, ring_lat, ring_bw, memory, act, float(costs.nbytes.grad),
               float(costs.nbytes.state), first, inverse.reshape(-1))

  @property
  def shape(self) -> tuple[int, int, int]:
    return self.grid.shape

  def param_counts(self, layers: np.ndarray, costs: costs_lib.ModelCosts) -> np.ndarray:
    """float [..., S, N]: parameters each position holds for partitions `layers` [..., S]: the
    most layers any stage holds, at the grid's capacity, and the replicated ones."""
    del costs
    layers = np.asarray(layers, np.float64)
    slots = layers.max(axis=-1)[..., None, None]
    return np.zeros(layers.shape + self.grid.shape[-1:]) + (slots * self.layer_params
                                                            + self.shared_params)

  def data_allreduce_s(self, params: np.ndarray) -> np.ndarray:
    """float [...]: the gradient all-reduces after the last tick: the replicated parameters'
    over the stages, then the slowest position's over the pipelines."""
    r_ = self.grid.shape[0]
    nbytes = self.grad_bytes * params
    t = np.zeros(nbytes.shape) + schedule_lib.allreduce_s(nbytes, r_, self.ring_latency_s,
                                                          self.ring_bandwidth)
    return t.max(axis=(-1, -2)) + self.pipe_allreduce_s

  def fits(self, params: np.ndarray, in_flight: np.ndarray, pipeline: int | None = None):
    """bool [..., R] (or [...] for one `pipeline`): whether every device of each pipeline holds
    its state and stash, for positions holding `params` [..., S, N] and stashes `in_flight`
    [S]."""
    need = (self.state_bytes * params
            + ((np.asarray(in_flight) + STASH_BUFFERS) * self.act_bytes)[:, None])   # [..., S, N]
    if pipeline is not None:
      return np.all(need <= self.memory[pipeline], axis=(-1, -2))
    return np.all(need[..., None, :, :] <= self.memory, axis=(-1, -2))

  def stage_seconds(self, layers: np.ndarray):
    """(f, b) float [..., R, S] per microbatch for partitions `layers` [..., S]."""
    layers = np.asarray(layers, np.float64)[..., None, :]
    return schedule_lib.stage_seconds(layers, self.compute_s, self.allreduce_s, self.edge_s)


def lower_bound(gc: GridCosts, costs: costs_lib.ModelCosts, num_microbatches: int,
                sync: bool) -> float:
  """Seconds no plan on this grid beats, whatever its partition, split and schedule.

  Every stage runs all of its pipeline's microbatches, so a pipeline with M_d microbatches takes
  at least M_d max_p layers_p w_dp (w = 4 c + 6 a: one layer's forward and backward)
  >= M_d L / sum_p 1 / w_dp; over pipelines the step is at least M L / sum_{d, p} 1 / w_dp
  (ssaw, async and local_sgd cannot beat the pipelines' combined rate either), plus, for sync,
  the data-parallel all-reduce with one layer per stage (parameters only grow with layers).
  """
  w = 4.0 * gc.compute_s + 6.0 * gc.allreduce_s
  if np.any(w <= 0):
    return 0.0
  bound = num_microbatches * costs.num_layers / float((1.0 / w).sum())
  if sync:
    ones = np.ones(gc.grid.shape[1])
    bound += float(gc.data_allreduce_s(gc.param_counts(ones, costs)))
  return bound


def mesh_bound(costs: costs_lib.ModelCosts, shape, tokens: int, num_microbatches: int,
               speed: float, link: tuple[float, float], sync: bool) -> float:
  """Seconds no plan with mesh `shape` (R, S, N) beats on devices whose speeds sum to `speed`
  and whose fastest link is `link` (the least latency, the most bandwidth), whatever the grid.

  `lower_bound` with each part at its least: a layer on the tensor group of (d, p) takes
  c_dp >= W / V_dp (W: one layer's forward compute at speed 1, every unit once; V_dp: the
  group's summed speed) and a_dp >= a, the all-reduce over `link`; 1 / w_dp <= V_dp / (4 W +
  6 a V_dp) is concave in V_dp and the groups' speeds sum to V, so sum_{d, p} 1 / w_dp <=
  V / (4 W + 6 a V / (R S)): the step is at least M L (4 W / V + 6 a / (R S)). For sync, plus
  the gradient all-reduces over `link` of the fewest parameters a position holds (ceil(L / S)
  layer slots of ceil(units / N) units of each kind, and the replicated ones).
  """
  r_, s_, n_ = shape
  unit_s = costs.unit_s(tokens)
  layer_s = sum(unit_s[k] * costs.num_units[k] for k in costs.kinds)
  a = schedule_lib.allreduce_s(costs.activation_bytes(tokens), n_, *link)
  bound = num_microbatches * costs.num_layers * (4.0 * layer_s / speed + 6.0 * a / (r_ * s_))
  if sync:
    shared = costs.first_params + costs.last_params
    per_layer = costs.layer_params + sum(costs.unit_params[k] * math.ceil(costs.num_units[k] / n_)
                                         for k in costs.kinds)
    params = math.ceil(costs.num_layers / s_) * per_layer + shared
    bound += (schedule_lib.allreduce_s(costs.nbytes.grad * params, r_, *link)
              + schedule_lib.allreduce_s(costs.nbytes.grad * shared, s_, *link))
  return bound


def pipeline_seconds(gc: GridCosts, costs: costs_lib.ModelCosts, layers, schedule: str,
                     pipeline: int, num_microbatches: int) -> float:
  """Seconds of one pipeline's step with `num_microbatches` (inf if a device cannot hold it)."""
  layers = np.asarray(layers, np.float64)
  masks = tick_masks(schedule, gc.grid.shape[1], num_microbatches)
  params = gc.param_counts(layers, costs)
  if not gc.fits(params, masks[2], pipeline):
    return np.inf
  f, b = schedule_lib.stage_seconds(layers, gc.compute_s[pipeline], gc.allreduce_s[pipeline],
                                    gc.edge_s[pipeline])
  return float(masked_step_time(masks, f, b, gc.send_s[pipeline]))


def pipeline_times(gc: GridCosts, costs: costs_lib.ModelCosts, partitions: np.ndarray,
                   schedule: str, num_microbatches: int) -> np.ndarray:
  """float [P, R]: every pipeline's seconds with `num_microbatches`, for each partition [P, S]
  (inf where a device cannot hold it). Pipelines of one type are priced once."""
  partitions = np.asarray(partitions, np.float64)
  first, inverse = gc.type_first, gc.type_of
  f, b = gc.stage_seconds(partitions)                                      # [P, R, S]
  masks = tick_masks(schedule, gc.grid.shape[1], num_microbatches)
  t = masked_step_time(masks, f[:, first], b[:, first], gc.send_s[first])  # [P, R']
  ok = gc.fits(gc.param_counts(partitions, costs), masks[2])[:, first]
  return np.where(ok, t, np.inf)[:, inverse]


def pipeline_table(gc: GridCosts, costs: costs_lib.ModelCosts, partitions: np.ndarray,
                   schedule: str, max_microbatches: int) -> np.ndarray:
  """float [P, R, K]: `pipeline_times` with m = 1..K microbatches."""
  return np.stack([pipeline_times(gc, costs, partitions, schedule, m)
                   for m in range(1, max_microbatches + 1)], axis=-1)


def assess(gc: GridCosts, costs: costs_lib.ModelCosts, partitions: np.ndarray, schedule: str,
           num_microbatches: int, sync: str = "sync") -> np.ndarray:
  """float [P]: the predicted seconds per global batch of each partition [P, S] (inf where no
  split fits). sync: the slowest pipeline under the best split plus the data-parallel
  all-reduce; other modes: an even split (inf unless R divides M), timed by
  `sync.predict.predict`."""
  partitions = np.asarray(partitions)
  r_ = gc.grid.shape[0]
  m_ = num_microbatches
  if m_ < r_:
    return np.full(len(partitions), np.inf)
  ar = gc.data_allreduce_s(gc.param_counts(partitions, costs))             # [P]
  if sync == "sync":
    if m_ - r_ + 1 <= TABLE_LIMIT:
      times = pipeline_table(gc, costs, partitions, schedule, m_ - r_ + 1)
      return split_lib.split_value(times, m_) + ar
    return np.array([best_split(gc, costs, layers, schedule, m_)[0]
                     for layers in partitions]) + ar
  if m_ % r_:
    return np.full(len(partitions), np.inf)
  replica = pipeline_times(gc, costs, partitions, schedule, m_ // r_)        # [P, R]
  out = np.full(len(partitions), np.inf)
  for i in range(len(partitions)):
    if np.all(np.isfinite(replica[i])):
      out[i] = sync_predict.predict(sync, replica[i], comm_s=float(ar[i])).batch_s
  return out


def best_split(gc: GridCosts, costs: costs_lib.ModelCosts, layers, schedule: str,
               num_microbatches: int, sync: str = "sync") -> tuple[float, tuple[int, ...]]:
  """(the slowest pipeline's seconds, microbatches per pipeline) of the split `assess` prices
  for one partition: for sync the best split (`split.balance_split`, started from a split by
  throughput), for the other modes the even split."""
  r_, s_, _ = gc.grid.shape
  m_ = num_microbatches
  if m_ < r_:
    return np.inf, ()
  first, inverse = gc.type_first, gc.type_of
  cache = {}

  def time_of(d, m):
    key = (int(inverse[d]), int(m))
    if key not in cache:
      cache[key] = pipeline_seconds(gc, costs, layers, schedule, int(first[key[0]]), m)
    return cache[key]

  if sync != "sync":
    even = (m_ // r_,) * r_
    return max(time_of(d, m_ // r_) for d in range(r_)), even
  probe = min(m_ - r_ + 1, 2 * s_ + 2)
  rates = np.full(r_, 1e-12)
  if probe > 1:
    for d in range(r_):
      gain = time_of(d, probe) - time_of(d, 1)
      if np.isfinite(gain) and gain > 0:
        rates[d] = (probe - 1) / gain
  start = split_lib.proportional_counts(m_, rates)
  return split_lib.balance_split(time_of, r_, m_, start)
