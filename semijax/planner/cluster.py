"""The devices a plan places work on: their speeds, memory, and the links between them.

A `Cluster` of D devices holds per device a relative speed v_i (the nominal device, which runs
`device_gflops`, has speed 1; conventionally the fastest) and its memory in bytes, and per pair of
devices a link: latency L_ij (seconds) and bandwidth W_ij (bytes/s), symmetric (the diagonal is
not used). Clusters are built per device pair, or from regions (`from_regions`: devices listed
region by region, a region-level latency/bandwidth matrix, its diagonal the link inside a
region, expanded to devices; `from_device_regions`: a region index per device, as a config
gives it; `two_level`: one link inside every region, one between any two).

`classes()` groups devices that are exactly interchangeable: swapping two of them leaves speeds,
memory and every link unchanged, so no plan's predicted time changes. The planner searches over
classes, not device ids.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from semijax import errors


def _frozen(x: np.ndarray) -> np.ndarray:
  x = np.array(x, np.float64)
  x.flags.writeable = False
  return x


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
  """splitmix64's finalizer, elementwise on uint64 arrays (a 64-bit hash, wrapping arithmetic)."""
  z = np.asarray(z, np.uint64) + _GOLDEN
  z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
  z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
  return z ^ (z >> np.uint64(31))


def link_regions(latency_s: np.ndarray, bandwidth: np.ndarray,
                 nbytes: float = 1e6) -> np.ndarray:
  """int [D]: regions read off a link matrix: devices i and j are neighbours when their link
  moves `nbytes` as fast as the fastest link of each; regions are the connected groups (the
  regions of a cluster whose links come from a region matrix with faster links inside regions;
  one region when every link is alike). Numbered in order of first device."""
  n = latency_s.shape[0]
  t = latency_s + nbytes / bandwidth
  np.fill_diagonal(t, np.inf)
  if n == 1:
    return np.zeros(1, np.int64)
  best = t.min(axis=1) * (1 + 1e-9)
  near = (t <= best[:, None]) & (t <= best[None, :])
  out = np.full(n, -1, np.int64)
  count = 0
  for i in range(n):
    if out[i] >= 0:
      continue
    out[i], frontier = count, np.array([i])
    while frontier.size:
      new = np.flatnonzero(near[frontier].any(axis=0) & (out < 0))
      out[new] = count
      frontier = new
    count += 1
  return out


@dataclasses.dataclass(frozen=True, eq=False)
class Cluster:
  """D devices and their links (see module doc).

  Attributes:
    speeds: float [D] relative speed of each device (> 0).
    memory: float [D] bytes each device can hold (> 0; inf for unbounded).
    latency_s: float [D, D] link latency in seconds (>= 0, symmetric).
    bandwidth: float [D, D] link bandwidth in bytes/s (> 0, symmetric; inf for a free link).
    regions: int [D] the region of each device (the hierarchical search lays pipelines out
      along regions; reports show them). When not given: the groups of devices joined by
      their fastest links (`link_regions`).
  """

  speeds: np.ndarray
  memory: np.ndarray
  latency_s: np.ndarray
  bandwidth: np.ndarray
  regions: np.ndarray | None = None

  def __post_init__(self):
    speeds = _frozen(self.speeds)
    n = speeds.size
    if speeds.ndim != 1 or n < 1 or not np.all(np.isfinite(speeds)) or np.any(speeds <= 0):
      raise errors.ConfigError(f"cluster.speeds: need one positive finite speed per device, got "
                               f"{np.asarray(self.speeds).tolist()}")
    memory = np.broadcast_to(np.asarray(self.memory, np.float64), (n,))
    if np.any(np.isnan(memory)) or np.any(memory <= 0):
      raise errors.ConfigError(f"cluster.memory: need positive bytes per device, got "
                               f"{memory.tolist()}")
    for name, low in (("latency_s", 0.0), ("bandwidth", None)):
      x = np.asarray(getattr(self, name), np.float64)
      if x.shape != (n, n):
        raise errors.ConfigError(f"cluster.{name}: need a [{n}, {n}] matrix, got shape {x.shape}")
      off = x[~np.eye(n, dtype=bool)]
      if np.any(np.isnan(off)) or (np.any(off < 0) if low is not None else np.any(off <= 0)):
        raise errors.ConfigError(f"cluster.{name}: entries must be "
                                 f"{'>= 0' if low is not None else '> 0'}, got {off.min()}")
      if name == "latency_s" and not np.all(np.isfinite(off)):
        raise errors.ConfigError("cluster.latency_s: entries must be finite")
      if not np.array_equal(x, x.T):
        raise errors.ConfigError(f"cluster.{name}: the matrix must be symmetric")
      object.__setattr__(self, name, _frozen(x))
    if self.regions is None:
      regions = link_regions(self.latency_s, self.bandwidth)
    else:
      regions = np.asarray(self.regions)
    if regions.shape != (n,) or regions.dtype.kind not in "iu" or np.any(regions < 0):
      raise errors.ConfigError(f"cluster.regions: need one region index >= 0 per device, got "
                               f"{regions.tolist()}")
    regions = regions.astype(np.int64).copy()
    regions.flags.writeable = False
    object.__setattr__(self, "speeds", speeds)
    object.__setattr__(self, "memory", _frozen(memory))
    object.__setattr__(self, "regions", regions)
    object.__setattr__(self, "_classes", self._find_classes())
    object.__setattr__(self, "_class_links", self._find_class_links())

  # --- builders -----------------------------------------------------------------------------

  @classmethod
  def from_regions(cls, region_speeds: Sequence[Sequence[float]], region_latency_s,
                   region_bandwidth, memory=np.inf) -> "Cluster":
    """Devices in regions, links from an R x R region matrix.

    Args:
      region_speeds: per region, the speeds of its devices (device ids run region by region).
      region_latency_s, region_bandwidth: float [R, R]; entry [r, q] is the link between a
        device of region r and one of region q; the diagonal is the link inside a region.
      memory: bytes per device: a scalar, or per region a scalar or one value per device.
    """
    r_ = len(region_speeds)
    if r_ < 1 or any(len(s) < 1 for s in region_speeds):
      raise errors.ConfigError("cluster.region_speeds: need at least one region, each with a "
                               "device")
    regions = np.concatenate([np.full(len(s), r) for r, s in enumerate(region_speeds)])
    speeds = np.concatenate([np.asarray(s, np.float64) for s in region_speeds])
    for name, m in (("region_latency_s", region_latency_s), ("region_bandwidth",
                                                               region_bandwidth)):
      if np.shape(m) != (r_, r_):
        raise errors.ConfigError(f"cluster.{name}: need a [{r_}, {r_}] matrix, got shape "
                                 f"{np.shape(m)}")
    if np.isscalar(memory) or (isinstance(memory, np.ndarray) and memory.ndim == 0):
      mem = np.full(len(speeds), float(memory))
    else:
      if len(memory) != r_:
        raise errors.ConfigError(f"cluster.memory: need a scalar or one entry per region "
                                 f"({r_}), got {len(memory)}")
      mem = np.concatenate([np.broadcast_to(np.asarray(m, np.float64), (len(s),))
                            for m, s in zip(memory, region_speeds)])
    lat = np.asarray(region_latency_s, np.float64)[np.ix_(regions, regions)]
    bw = np.asarray(region_bandwidth, np.float64)[np.ix_(regions, regions)]
    return cls(speeds, mem, lat, bw, regions)

  @classmethod
  def from_device_regions(cls, speeds: Sequence[float], regions: Sequence[int],
                          region_latency_s, region_bandwidth, memory=np.inf) -> "Cluster":
    """Devices in any order, each with its region index (0..R-1), links from an R x R region
    matrix (as `from_regions`); memory: a scalar or one value per device."""
    regions = np.asarray(regions)
    speeds = np.asarray(speeds, np.float64)
    if regions.shape != speeds.shape or regions.dtype.kind not in "iu" or np.any(regions < 0):
      raise errors.ConfigError(f"cluster.regions: need one region index >= 0 per device "
                               f"({speeds.size}), got {regions.tolist()}")
    r_ = int(regions.max()) + 1 if regions.size else 0
    for name, m in (("region_latency_s", region_latency_s),
                    ("region_bandwidth", region_bandwidth)):
      if np.shape(m) != (r_, r_):
        raise errors.ConfigError(f"cluster.{name}: need a [{r_}, {r_}] matrix, got shape "
                                 f"{np.shape(m)}")
    lat = np.asarray(region_latency_s, np.float64)[np.ix_(regions, regions)]
    bw = np.asarray(region_bandwidth, np.float64)[np.ix_(regions, regions)]
    return cls(speeds, memory, lat, bw, regions)

  @classmethod
  def two_level(cls, region_speeds: Sequence[Sequence[float]], intra: tuple[float, float],
                inter: tuple[float, float], memory=np.inf) -> "Cluster":
    """Regions with one link (latency s, bandwidth bytes/s) inside each region (`intra`) and one
    between any two regions (`inter`)."""
    r_ = len(region_speeds)
    eye = np.eye(r_, dtype=bool)
    lat = np.where(eye, intra[0], inter[0])
    bw = np.where(eye, intra[1], inter[1])
    return cls.from_regions(region_speeds, lat, bw, memory)

  def without_links(self) -> "Cluster":
    """The same devices with free links (latency 0, infinite bandwidth): what a planner that
    knows only device speeds sees."""
    n = self.num_devices
    return Cluster(self.speeds, self.memory, np.zeros((n, n)), np.full((n, n), np.inf),
                   self.regions)

  # --- queries ------------------------------------------------------------------------------

  @property
  def num_devices(self) -> int:
    return int(self.speeds.size)

  def classes(self) -> np.ndarray:
    """int [D]: a class id per device; devices of one class are interchangeable (module doc).
    Ids are numbered in order of first appearance."""
    return self._classes

  def _find_classes(self) -> np.ndarray:
    """Classes of swappable devices, numbered in order of first device (`classes`).

    Swappability is an equivalence (a transposition composed of swaps is a swap), so a device
    joins the class of any earlier device it can swap with. Candidates come from a hash that
    swappable devices share: with x(i, k) a 64-bit code of link (i, k) and h(k, x) a hash of
    the pair, A_i = XOR_{k != i} h(k, x(i, k)); if i and j can swap, their rows agree outside
    {i, j} and x(i, j) = x(j, i) = x (links are symmetric), so A_i ^ h(i, x) = A_j ^ h(j, x)
    (both are the XOR over the common part, h(i, x) and h(j, x)). Each candidate is then
    checked exactly (`_swappable`): O(D^2) array work for the hashes, instead of one O(D)
    comparison per (device, class) pair (4,096 devices in ~700 classes: seconds, not half a
    minute).
    """
    n = self.num_devices
    out = np.full(n, -1, np.int64)
    bits = lambda m: np.ascontiguousarray(m + 0.0).view(np.uint64)     # + 0.0: -0.0 -> 0.0
    code = _mix(bits(self.latency_s) ^ _mix(bits(self.bandwidth)))        # [D, D]
    salt = np.arange(n, dtype=np.uint64) * _GOLDEN                         # [D]
    terms = _mix(code ^ salt[None, :])                                     # h(k, x(i, k))
    a = np.bitwise_xor.reduce(terms, axis=1) ^ terms[np.arange(n), np.arange(n)]
    # Each row's distinct link codes but its own (the diagonal repeats a neighbour's code).
    rows = code.copy()
    if n > 1:
      rows[np.arange(n), np.arange(n)] = code[np.arange(n), (np.arange(n) + 1) % n]
    rows.sort(axis=1)
    distinct = np.ones(rows.shape, bool)
    distinct[:, 1:] = rows[:, 1:] != rows[:, :-1]
    reps: dict[tuple, list[int]] = {}     # (speed, memory, x, A_r ^ h(r, x)) -> class firsts
    count = 0
    for i in range(n):
      xs = rows[i][distinct[i]]
      keys = [(float(self.speeds[i]), float(self.memory[i]), int(x), int(k))
              for x, k in zip(xs, a[i] ^ _mix(xs ^ salt[i]))]
      found = next((int(out[rep]) for key in keys for rep in reps.get(key, ())
                    if int(code[i, rep]) == key[2] and self._swappable(i, rep)), -1)
      if found < 0:
        found, count = count, count + 1
        for key in keys:
          reps.setdefault(key, []).append(i)
      out[i] = found
    out.flags.writeable = False
    return out

  def class_links(self) -> tuple[np.ndarray, np.ndarray]:
    """(latency_s, bandwidth) float [K, K] over the K classes: entry [a, b] is the link between
    any device of class a and any other of class b. Interchangeable devices make it one link:
    swapping two devices of a class leaves every link unchanged. Entries of a class with one
    device to itself are (0, inf) and never used."""
    return self._class_links

  def _find_class_links(self):
    classes = self._classes
    k = int(classes.max()) + 1
    _, first = np.unique(classes, return_index=True)                        # [K] class order
    count = np.bincount(classes, minlength=k)
    second = np.array([np.flatnonzero(classes == c)[1] if count[c] > 1 else first[c]
                       for c in range(k)])
    lat = self.latency_s[np.ix_(first, first)].copy()
    bw = self.bandwidth[np.ix_(first, first)].copy()
    pair = count > 1
    lat[np.diag_indices(k)] = np.where(pair, self.latency_s[first, second], 0.0)
    bw[np.diag_indices(k)] = np.where(pair, self.bandwidth[first, second], np.inf)
    for x in (lat, bw):
      x.flags.writeable = False
    return lat, bw

  def _swappable(self, i: int, j: int) -> bool:
    if self.speeds[i] != self.speeds[j] or self.memory[i] != self.memory[j]:
      return False
    keep = np.ones(self.num_devices, bool)
    keep[[i, j]] = False
    return bool(np.array_equal(self.latency_s[i, keep], self.latency_s[j, keep])
                and np.array_equal(self.bandwidth[i, keep], self.bandwidth[j, keep]))

  def group_link(self, devices) -> tuple[float, float]:
    """(latency, bandwidth) of the slowest link among `devices`: the largest latency and the
    smallest bandwidth over their pairs ((0, inf) for one device)."""
    lat, bw = self._pair_links(devices)
    return (float(lat.max()), float(bw.min())) if lat.size else (0.0, np.inf)

  def fastest_link(self, devices) -> tuple[float, float]:
    """(latency, bandwidth) no link among `devices` beats: the smallest latency and the largest
    bandwidth over their pairs ((0, inf) for one device)."""
    lat, bw = self._pair_links(devices)
    return (float(lat.min()), float(bw.max())) if lat.size else (0.0, np.inf)

  def _pair_links(self, devices) -> tuple[np.ndarray, np.ndarray]:
    """(latency, bandwidth) float [pairs] of every ordered pair of distinct `devices`."""
    d = np.asarray(devices, np.int64).reshape(-1)
    rows, cols = np.nonzero(~np.eye(d.size, dtype=bool))
    return self.latency_s[d[rows], d[cols]], self.bandwidth[d[rows], d[cols]]

  def to_dict(self) -> dict:
    return {"speeds": self.speeds.tolist(), "memory": self.memory.tolist(),
            "regions": self.regions.tolist(), "latency_s": self.latency_s.tolist(),
            "bandwidth": self.bandwidth.tolist()}
