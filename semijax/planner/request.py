"""What a planning call asks for, validated once, and the best candidate found so far.

A `Request` holds the model's costs, the cluster, the global batch (examples per step) and the
choices the planner may take: microbatch sizes (examples; each must divide the global batch),
pipeline schedules and data-parallel sync modes. A `Candidate` is a point of the plan space
with its predicted seconds: a device grid [data, pipe, tensor] (of all the cluster's devices,
or of some, the others left idle), the layers per stage, the microbatch size, schedule and sync
mode (the unit split and the microbatch split follow from them by the planner's rules).
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Sequence

import numpy as np

from semijax import errors
from semijax.core import schedule as schedule_lib
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import evaluate
from semijax.sync import settings as sync_settings


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
  """A validated planning request (see module doc). Bad arguments raise `errors.ConfigError`
  (a ValueError) naming them."""

  costs: costs_lib.ModelCosts
  cluster: cluster_lib.Cluster
  global_batch: int
  microbatch_sizes: tuple[int, ...] = (1,)
  schedules: tuple[str, ...] = schedule_lib.SCHEDULES
  syncs: tuple[str, ...] = ("sync",)

  def __post_init__(self):
    b = self.global_batch
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1:
      raise errors.ConfigError(f"global_batch: must be an integer >= 1, got {b!r}")
    sizes = tuple(self.microbatch_sizes)
    if not sizes or any(isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1
                        or b % m for m in sizes):
      raise errors.ConfigError(f"microbatch_sizes: need integers >= 1 that divide global_batch "
                               f"{b}, got {sizes}")
    for name, allowed in (("schedules", schedule_lib.SCHEDULES), ("syncs", sync_settings.MODES)):
      got = tuple(getattr(self, name))
      if not got or any(x not in allowed for x in got):
        raise errors.ConfigError(f"{name}: need a non-empty subset of {allowed}, got {got}")
      object.__setattr__(self, name, tuple(dict.fromkeys(got)))
    object.__setattr__(self, "microbatch_sizes", tuple(sorted(set(int(m) for m in sizes))))

  @property
  def num_devices(self) -> int:
    return self.cluster.num_devices

  def factorizations(self, devices: int | None = None) -> list[tuple[int, int, int]]:
    """Every (data, pipe, tensor) with data * pipe * tensor = `devices` (default: all D),
    pipe <= layers, tensor <= the fewest units of a kind, and data <= the most microbatches
    any microbatch size gives."""
    n = self.num_devices if devices is None else devices
    most = self.global_batch // min(self.microbatch_sizes)
    out = []
    for tensor in range(1, n + 1):
      if n % tensor or tensor > self.costs.max_tensor():
        continue
      for pipe in range(1, n // tensor + 1):
        if (n // tensor) % pipe or pipe > self.costs.num_layers:
          continue
        data = n // (tensor * pipe)
        if data <= most:
          out.append((data, pipe, tensor))
    return out

  def tokens(self, microbatch_size: int) -> int:
    return microbatch_size * self.costs.seq_len

  def mesh_bounds(self, devices) -> dict[tuple[int, int, int], float]:
    """{mesh: seconds no plan of that mesh on `devices` (device ids; the others idle) beats}
    for every mesh of `factorizations(len(devices))` (`evaluate.mesh_bound`, at the best
    microbatch size and sync mode)."""
    devices = np.asarray(devices, np.int64).reshape(-1)
    speed = float(self.cluster.speeds[devices].sum())
    link = self.cluster.fastest_link(devices)

    def bound(shape):
      return min((evaluate.mesh_bound(self.costs, shape, self.tokens(mb), self.global_batch // mb,
                                      speed, link, sync == "sync")
                  for mb in self.microbatch_sizes if self.global_batch // mb >= shape[0]
                  for sync in self.syncs), default=np.inf)

    return {shape: bound(shape) for shape in self.factorizations(devices.size)}

  def with_cluster(self, cluster: cluster_lib.Cluster) -> "Request":
    return dataclasses.replace(self, cluster=cluster)


@dataclasses.dataclass(frozen=True, eq=False)
class Candidate:
  """A point of the plan space and its predicted seconds per global batch."""

  value: float
  grid: np.ndarray
  layers: tuple[int, ...]
  microbatch_size: int
  schedule: str
  sync: str


def better(a: Candidate | None, b: Candidate | None) -> Candidate | None:
  """The faster of two candidates (either may be None); the first on a tie."""
  if b is None or (a is not None and a.value <= b.value):
    return a
  return b


def bounded(req: Request, grid: np.ndarray,
            data: int) -> Iterator[tuple[evaluate.GridCosts, int, str, float]]:
  """(grid costs, microbatch size, sync mode, `evaluate.lower_bound`) of `grid` (int
  [R, S, N] device ids, `data` = R pipelines) for every microbatch size that gives each
  pipeline at least one microbatch, and every sync mode: what both searches enumerate."""
  for mb in req.microbatch_sizes:
    m_ = req.global_batch // mb
    if m_ < data:
      continue
    gc = evaluate.GridCosts.of(grid, req.costs, req.cluster, req.tokens(mb))
    for sync in req.syncs:
      yield gc, mb, sync, evaluate.lower_bound(gc, req.costs, m_, sync == "sync")


def cheapest(req: Request, gc: evaluate.GridCosts, partitions: np.ndarray, microbatch_size: int,
             schedule: str, sync: str) -> Candidate | None:
  """The fastest of `partitions` (int [K, S] layers per stage) on `gc`, priced by
  `evaluate.assess`; None when none fits in memory."""
  values = evaluate.assess(gc, req.costs, partitions, schedule,
                           req.global_batch // microbatch_size, sync)
  i = int(np.argmin(values))
  if not np.isfinite(values[i]):
    return None
  return Candidate(float(values[i]), gc.grid, tuple(int(x) for x in partitions[i]),
                   microbatch_size, schedule, sync)


def as_request(costs, cluster, global_batch, microbatch_sizes: Sequence[int] = (1,),
               schedules: Sequence[str] = schedule_lib.SCHEDULES,
               syncs: Sequence[str] = ("sync",)) -> Request:
  return Request(costs, cluster, int(global_batch) if isinstance(global_batch, np.integer)
                 else global_batch, tuple(microbatch_sizes), tuple(schedules), tuple(syncs))
