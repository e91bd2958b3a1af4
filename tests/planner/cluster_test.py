"""Clusters: builders, validation that names the field, interchangeable device classes and
the slowest links of groups."""

import numpy as np
import pytest

from semijax import errors
from semijax.planner import cluster as cluster_lib


def test_regions_expand_to_devices():
  c = cluster_lib.Cluster.from_regions(
      [[1.0, 0.5], [0.25]], [[1e-6, 1e-3], [1e-3, 2e-6]], [[1e10, 1e8], [1e8, 5e9]],
      memory=[8e9, [4e9]])
  assert c.num_devices == 3
  np.testing.assert_array_equal(c.regions, [0, 0, 1])
  np.testing.assert_array_equal(c.memory, [8e9, 8e9, 4e9])
  assert c.latency_s[0, 1] == 1e-6 and c.latency_s[0, 2] == 1e-3
  assert c.bandwidth[2, 1] == 1e8
  assert c.group_link([0, 1]) == (1e-6, 1e10)
  assert c.group_link([0, 1, 2]) == (1e-3, 1e8)
  assert c.group_link([2]) == (0.0, np.inf)
  again = cluster_lib.Cluster.from_device_regions(
      [0.25, 1.0, 0.5], [1, 0, 0], [[1e-6, 1e-3], [1e-3, 2e-6]], [[1e10, 1e8], [1e8, 5e9]],
      memory=[4e9, 8e9, 8e9])
  perm = [1, 2, 0]
  np.testing.assert_array_equal(again.latency_s[np.ix_(perm, perm)], c.latency_s)
  np.testing.assert_array_equal(again.bandwidth[np.ix_(perm, perm)], c.bandwidth)
  np.testing.assert_array_equal(again.memory[perm], c.memory)
  free = c.without_links()
  assert free.group_link([0, 2]) == (0.0, np.inf)
  np.testing.assert_array_equal(free.speeds, c.speeds)


def test_classes_are_exactly_the_interchangeable_devices():
  c = cluster_lib.Cluster.two_level([[1.0, 1.0, 0.5], [1.0, 1.0]], intra=(1e-6, 1e10),
                                    inter=(1e-3, 1e8))
  cls = c.classes()
  assert cls[0] == cls[1] != cls[2] and cls[3] == cls[4] != cls[0]
  lat, bw = c.class_links()
  for i in range(5):
    for j in range(5):
      if i != j:
        assert lat[cls[i], cls[j]] == c.latency_s[i, j]
        assert bw[cls[i], cls[j]] == c.bandwidth[i, j]
  # Per-pair links: equal speeds but one link differs, so no two devices are swappable.
  lat = np.full((3, 3), 1e-6)
  lat[0, 2] = lat[2, 0] = 1e-3
  c = cluster_lib.Cluster(np.ones(3), np.inf, lat, np.full((3, 3), 1e9))
  assert len(set(c.classes().tolist())) == 2          # devices 0 and 2 still swap
  assert c.classes()[0] == c.classes()[2]


def test_swapping_a_class_leaves_the_cluster_unchanged():
  rng = np.random.default_rng(0)
  for _ in range(20):
    c = cluster_lib.Cluster.two_level(
        [list(rng.choice([1.0, 0.5], rng.integers(1, 4))) for _ in range(rng.integers(1, 4))],
        intra=(1e-6, 1e10), inter=(1e-3, 1e8), memory=8e9)
    cls = c.classes()
    for i in range(c.num_devices):
      for j in range(c.num_devices):
        perm = np.arange(c.num_devices)
        perm[[i, j]] = perm[[j, i]]
        same = (np.array_equal(c.speeds[perm], c.speeds)
                and np.array_equal(c.latency_s[np.ix_(perm, perm)], c.latency_s)
                and np.array_equal(c.bandwidth[np.ix_(perm, perm)], c.bandwidth))
        assert same == (cls[i] == cls[j])


def _greedy_classes(c):
  """The definition, pair by pair: a device joins the first class whose first device it can swap
  with (equal speed and memory, equal links to every other device)."""
  reps, out = [], []
  for i in range(c.num_devices):
    for k, r in enumerate(reps):
      keep = np.ones(c.num_devices, bool)
      keep[[i, r]] = False
      if (c.speeds[i] == c.speeds[r] and c.memory[i] == c.memory[r]
          and np.array_equal(c.latency_s[i, keep], c.latency_s[r, keep])
          and np.array_equal(c.bandwidth[i, keep], c.bandwidth[r, keep])):
        out.append(k)
        break
    else:
      out.append(len(reps))
      reps.append(i)
  return np.array(out)


def test_classes_and_class_links_match_the_pairwise_definition():
  rng = np.random.default_rng(1)
  for trial in range(30):
    n = int(rng.integers(2, 13))
    if trial % 3 == 0:      # a ring: every device has the same sorted links, few can swap
      hops = np.abs(np.arange(n)[:, None] - np.arange(n)[None, :])
      lat = np.minimum(hops, n - hops) * 1e-3
    else:                   # a few link values, symmetric
      lat = rng.choice([1e-6, 1e-3], (n, n))
      lat = np.triu(lat, 1) + np.triu(lat, 1).T
    bw = np.where(lat > 1e-4, 1e8, 1e10)
    c = cluster_lib.Cluster(rng.choice([1.0, 0.5], n), rng.choice([4e9, 8e9], n), lat, bw)
    np.testing.assert_array_equal(c.classes(), _greedy_classes(c))
    cls = c.classes()
    lat_k, bw_k = c.class_links()
    for i in range(n):
      for j in range(n):
        if i != j:
          assert (lat_k[cls[i], cls[j]], bw_k[cls[i], cls[j]]) == (lat[i, j], bw[i, j])


@pytest.mark.parametrize("kw,field", [
    (dict(speeds=[1.0, 0.0]), "cluster.speeds"),
    (dict(memory=[1.0, -1.0]), "cluster.memory"),
    (dict(latency_s=[[0, -1], [-1, 0]]), "cluster.latency_s"),
    (dict(bandwidth=[[1, 0], [0, 1]]), "cluster.bandwidth"),
    (dict(bandwidth=[[1, 2], [3, 1]]), "cluster.bandwidth"),
    (dict(latency_s=np.zeros((3, 3))), "cluster.latency_s"),
    (dict(regions=[0, -1]), "cluster.regions"),
])
def test_bad_clusters_name_the_field(kw, field):
  args = dict(speeds=[1.0, 0.5], memory=1e9, latency_s=np.zeros((2, 2)),
              bandwidth=np.ones((2, 2)), regions=None)
  args.update(kw)
  with pytest.raises(errors.ConfigError, match=field):
    cluster_lib.Cluster(**args)
  with pytest.raises(errors.ConfigError, match="region_latency_s"):
    cluster_lib.Cluster.from_regions([[1.0], [1.0]], np.zeros((3, 3)), np.ones((2, 2)))


def test_regions_read_off_the_links():
  c = cluster_lib.Cluster.two_level([[1.0, 0.5, 0.5], [1.0], [0.7, 0.7]], intra=(1e-6, 1e10),
                                    inter=(1e-3, 1e8))
  bare = cluster_lib.Cluster(c.speeds, c.memory, c.latency_s, c.bandwidth)
  np.testing.assert_array_equal(bare.regions, c.regions)
  alike = cluster_lib.Cluster(np.ones(4), np.inf, np.full((4, 4), 1e-6), np.full((4, 4), 1e9))
  np.testing.assert_array_equal(alike.regions, np.zeros(4))
