"""The shape of a simulated cluster and what its collectives cost.

Devices form a `data` x `pipe` x `tensor` grid (device id = (r * pipe + s) * tensor + t for
replica r, stage s, tensor position t). Traffic goes where links carry it (docs/pipeline.md): a
tensor group sits inside one node (`tensor` links), pipeline stages of one replica talk over
`pipe` links, replicas of one region over `data` links, and the replicas are split evenly
over `regions` (`region` links between them; a data-parallel ring that crosses regions runs at
the slowest region link it uses).

Collectives are the ring algorithms: an all-reduce of b bytes over n members sends
2 (n - 1) / n * b bytes per member in 2 (n - 1) rounds, each paying the link latency.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from semijax.errors import ConfigError
from semijax.sim import hardware as hardware_lib


@dataclasses.dataclass(frozen=True)
class Cluster:
  """A `data` x `pipe` x `tensor` grid of devices over `regions` (see module doc)."""

  data: int = 1
  pipe: int = 1
  tensor: int = 8
  regions: int = 1

  def __post_init__(self):
    for name in ("data", "pipe", "tensor", "regions"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"sim.cluster.{name}: must be an integer >= 1, got {v!r}")
    if self.data % self.regions:
      raise ConfigError(f"sim.cluster.regions: {self.regions} regions do not divide "
                        f"{self.data} data-parallel replicas")

  @property
  def devices(self) -> int:
    return self.data * self.pipe * self.tensor

  @property
  def shape(self) -> tuple[int, int, int]:
    """(data, pipe, tensor): the axes of every per-device array [R, S, T]."""
    return (self.data, self.pipe, self.tensor)

  def replica_regions(self) -> np.ndarray:
    """int [R]: the region of each data-parallel replica (contiguous blocks)."""
    return np.arange(self.data) // (self.data // self.regions)

  @classmethod
  def of_size(cls, devices: int, *, tensor: int = 8, pipe: int = 1, regions: int = 1) -> "Cluster":
    """The cluster of `devices` devices with these tensor and pipeline sizes (data = the rest)."""
    if devices % (tensor * pipe):
      raise ConfigError(f"sim.cluster.devices: {devices} is not a multiple of tensor x pipe = "
                        f"{tensor * pipe}")
    return cls(devices // (tensor * pipe), pipe, tensor, regions)


def allreduce_s(link: hardware_lib.Link, nbytes: float, members: int, factor: float = 1.0):
  """Seconds of a ring all-reduce of `nbytes` over `members` on `link` (0 for one member)."""
  if members <= 1:
    return 0.0
  rounds = 2 * (members - 1)
  return rounds * link.latency_s + rounds / members * nbytes / (link.bytes_per_s * factor)


def data_ring_s(cluster: Cluster, hw: hardware_lib.Hardware, nbytes: float,
                region_factors: np.ndarray) -> float:
  """Seconds of the data-parallel all-reduce of `nbytes` per device over the replicas: inside a
  region over `data` links; across regions the ring also crosses `region` links, at the slowest
  region's bandwidth factor (`region_factors` [regions])."""
  if cluster.data <= 1:
    return 0.0
  if cluster.regions == 1:
    return allreduce_s(hw.link("data"), nbytes, cluster.data)
  # One ring through every replica: its slowest hop is a region link.
  region = hw.link("region")
  data = hw.link("data")
  slowest = min(region.bytes_per_s * float(np.min(region_factors)), data.bytes_per_s)
  link = hardware_lib.Link(max(region.latency_s, data.latency_s), slowest)
  return allreduce_s(link, nbytes, cluster.data)
