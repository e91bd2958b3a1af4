"""The planner is optimal: on dozens of random small clusters its plan predicts exactly the
least step time an independent exhaustive search (`brute_force`) finds. Plus its symmetry
reduction, its placement on slow links, its baselines, its arguments and a large cluster."""

import dataclasses
import itertools

import numpy as np
import pytest

import brute_force
from helpers import GPT_KW
from semijax import models
from semijax.planner import baselines
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import exact
from semijax.planner import predict
from semijax.planner import request
from semijax.planner import search


def random_case(seed):
  """A cluster of 2-5 devices (1-3 regions or per-pair links, random speeds, memory that
  sometimes binds), a model of 2-5 layers and a batch; per-pair clusters have no key."""
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 6))
  if rng.random() < 0.35:
    speeds = rng.uniform(0.2, 1.0, n)
    lat = rng.uniform(1e-6, 1e-3, (n, n))
    bw = 10 ** rng.uniform(6.5, 9.5, (n, n))
    cluster = cluster_lib.Cluster(speeds, np.inf, (lat + lat.T) / 2, np.minimum(bw, bw.T))
    same = None
  else:
    regions = np.sort(rng.integers(0, int(rng.integers(1, 4)), n))
    groups = [[float(rng.choice([1.0, 0.6, 0.3])) for i in range(n) if regions[i] == r]
              for r in sorted(set(regions))]
    k = len(groups)
    lat = rng.uniform(1e-6, 1e-3, (k, k))
    bw = 10 ** rng.uniform(6.5, 9.5, (k, k))
    memory = np.inf if rng.random() < 0.6 else float(rng.uniform(3e5, 3e6))
    cluster = cluster_lib.Cluster.from_regions(groups, (lat + lat.T) / 2, np.minimum(bw, bw.T),
                                               memory)
    # Devices with the same speed in the same region are interchangeable in this builder.
    same = [(float(cluster.speeds[i]), int(cluster.regions[i])) for i in range(n)]
  layers = int(rng.integers(2, 6))
  d_ff, heads = int(rng.choice([8, 24, 64])), int(rng.choice([2, 4]))
  costs = costs_lib.ModelCosts(
      num_layers=layers, d_model=32, seq_len=int(rng.choice([16, 32])),
      num_units={"mlp": d_ff, "heads": heads},
      flops_per_unit={"mlp": 128.0, "heads": 256.0 * 32 / heads + 1000.0},
      unit_params={"mlp": 65, "heads": 4 * 32 * 32 // heads}, layer_params=192,
      first_params=2560, last_params=2112, device_gflops=float(rng.choice([0.01, 0.1, 1.0])),
      # The embedding and head's compute, from 0 to several layers' worth (its own draws, so
      # the cases' other draws stay as they were).
      **dict(zip(("first_flops", "last_flops"),
                 np.random.default_rng(seed + 1000).choice([0.0, 300.0, 3000.0, 20000.0], 2))))
  batch = int(rng.choice([2, 4, 6]))
  sizes = tuple(m for m in (1, 2, 3) if batch % m == 0)[:int(rng.integers(1, 3))]
  syncs = ("sync", "ssaw") if rng.random() < 0.2 else ("sync",)
  return costs, cluster, batch, sizes, syncs, same


@pytest.mark.parametrize("seed", range(36))
def test_the_planner_finds_the_exhaustive_optimum(seed):
  costs, cluster, batch, sizes, syncs, same = random_case(seed)
  want, _ = brute_force.best_plan(costs, cluster, batch, sizes, ("gpipe", "1f1b"), syncs, same)
  if not np.isfinite(want):
    with pytest.raises(ValueError, match="cluster.memory"):
      search.plan(costs, cluster, batch, sizes, syncs=syncs)
    return
  plan = search.plan(costs, cluster, batch, sizes, syncs=syncs)
  assert plan.predicted_s == pytest.approx(want, rel=1e-9)
  again = predict.predict(plan, costs, cluster)
  assert again["memory_ok"] and again["step_s"] == pytest.approx(plan.predicted_s, rel=1e-12)


def test_most_random_cases_are_feasible_and_varied():
  # The optimality test above is only as strong as its cases: most must have a plan, and the
  # optima must use pipelines, tensor groups and data parallelism.
  meshes = []
  for seed in range(36):
    costs, cluster, batch, sizes, syncs, _ = random_case(seed)
    try:
      p = search.plan(costs, cluster, batch, sizes, syncs=syncs)
    except ValueError:
      continue
    meshes.append((p.data, p.pipe, p.tensor))
  assert len(meshes) >= 24
  for axis in range(3):
    assert any(m[axis] > 1 for m in meshes)


def orbit(grid):
  """The smallest row-major sequence over every order of the pipelines: one key per orbit of the
  symmetry the exact search uses besides interchangeable devices."""
  return min(tuple(grid[list(pr)].reshape(-1))
             for pr in itertools.permutations(range(grid.shape[0])))


def test_canonical_grids_meet_every_orbit_once():
  rng = np.random.default_rng(0)
  for _ in range(12):
    n = int(rng.integers(2, 7))
    labels = rng.integers(0, int(rng.integers(1, n + 1)), n)
    for r_, s_ in itertools.product(range(1, n + 1), repeat=2):
      if n % (r_ * s_):
        continue
      shape = (r_, s_, n // (r_ * s_))
      canon = [orbit(g) for g in exact.canonical_label_grids(labels, shape)]
      every = {orbit(np.asarray(p).reshape(shape)) for p in set(itertools.permutations(labels))}
      assert sorted(canon) == sorted(every)          # each orbit exactly once


def test_label_sets_meet_every_choice_of_devices_once():
  rng = np.random.default_rng(3)
  for _ in range(10):
    n = int(rng.integers(1, 7))
    labels = rng.integers(0, int(rng.integers(1, n + 1)), n)
    sets = [tuple(s) for s in exact.label_sets(labels)]
    every = {tuple(sorted(labels[list(c)])) for k in range(1, n + 1)
             for c in itertools.combinations(range(n), k)}
    assert len(sets) == len(every) and set(sets) == every
    assert sets[0] == tuple(sorted(labels))                 # every device first
    assert exact.num_label_sequences(labels).tolist() == [
        len(set(itertools.permutations(labels, k))) for k in range(n + 1)]


def test_tensor_positions_are_not_interchangeable():
  # Found by a longer random run: two replicas of a tensor group of 2, speeds (1, 0.5) in one
  # and (1, 1) in the other. Swapping the positions of the first replica alone changes which
  # device is slowest at each position; the unit split breaks its tie differently (8 heads:
  # (6, 2) for slowest speeds (1, 0.5), (3, 5) for (0.5, 1)), and the second replica's compute
  # with it. The planner must search both orders.
  lat = np.array([[2.69e-5, 4.88e-4], [4.88e-4, 1.16e-4]])
  bw = np.array([[8.69e8, 4.86e7], [4.86e7, 2.82e8]])
  cluster = cluster_lib.Cluster.from_regions([[1.0, 0.5], [1.0, 1.0]], lat, bw)
  costs = costs_lib.ModelCosts(
      num_layers=3, d_model=32, seq_len=16, num_units={"mlp": 24, "heads": 8},
      flops_per_unit={"mlp": 128.0, "heads": 4096.0 + 1024.0},
      unit_params={"mlp": 65, "heads": 4 * 32 * 4 + 12}, layer_params=192, first_params=2560,
      last_params=2112, device_gflops=1.0)
  want, best = brute_force.best_plan(costs, cluster, 4, (2,), ("gpipe", "1f1b"),
                                     same_devices=[(1.0, 0), (0.5, 0), (1.0, 1), (1.0, 1)])
  plan = search.plan(costs, cluster, 4, (2,))
  assert plan.predicted_s == pytest.approx(want, rel=1e-9)
  assert (best.device_order, best.stage_units[0]["heads"]) == ((1, 0, 2, 3), (3, 5))
  swapped = dataclasses.replace(best, device_order=(0, 1, 2, 3),
                                stage_units=({"mlp": (16, 8), "heads": (6, 2)},))
  assert predict.predict(swapped, costs, cluster)["step_s"] > want * 1.05   # the other order


def two_regions(per_region=4, inter=(5e-3, 1e8)):
  """Two regions of equal devices (half fast, half slow) joined by a slow link."""
  speeds = [1.0] * (per_region // 2) + [0.5] * (per_region - per_region // 2)
  return cluster_lib.Cluster.two_level([speeds, speeds], intra=(5e-6, 5e10), inter=inter,
                                       memory=8e9)


GPT_COSTS = costs_lib.ModelCosts(
    num_layers=8, d_model=512, seq_len=256, num_units={"mlp": 2048, "heads": 8},
    flops_per_unit={"mlp": 4 * 512.0, "heads": 8 * 512.0 * 64 + 2 * 256 * 64},
    unit_params={"mlp": 2 * 512 + 1, "heads": 4 * 512 * 64 + 3 * 64}, layer_params=6 * 512,
    first_params=(256 + 256) * 512, last_params=2 * 512 + 512 * 256, device_gflops=50.0)


def test_tensor_groups_stay_inside_regions():
  cluster = two_regions()
  plan = search.plan(GPT_COSTS, cluster, 8, (1, 2))
  regions = cluster.regions[plan.grid()]
  # Tensor groups of 4 inside each region; the stage boundary (activations only) crosses.
  assert plan.tensor > 1 and np.all(regions == regions[..., :1]), plan
  # A planner blind to links puts the slow link where it costs most.
  blind = baselines.compute_only(GPT_COSTS, cluster, 8, (1, 2))
  assert plan.predicted_s < 0.5 * blind.predicted_s


def test_the_planner_beats_or_ties_every_baseline():
  for cluster in (two_regions(), two_regions(inter=(1e-5, 2e10))):
    plans = {name: fn(GPT_COSTS, cluster, 8, (1, 2))
             for name, fn in baselines.BASELINES.items()}
    for name, p in plans.items():
      assert p.breakdown is not None and p.num_devices == 8
      assert plans["full"].predicted_s <= p.predicted_s * (1 + 1e-12), name
    assert plans["megatron"].pipe == 1
    assert plans["even_pipeline"].pipe >= 2
    assert len(set(plans["even_pipeline"].stage_layers)) == 1
  # Uneven speeds are worth uneven work: the planner gains over the even pipeline.
  assert plans["full"].predicted_s < 0.9 * plans["even_pipeline"].predicted_s


@pytest.mark.parametrize("fields, mu_dtype, memory", [
    # 12 bytes a parameter need >= 147 kB on two devices; bfloat16 storage 6 bytes (75 kB), or
    # 8 with a float32 first moment (99 kB).
    ({"param_dtype": "bfloat16"}, "", 1.2e5), ({"param_dtype": "bfloat16"}, "float32", 1.2e5),
    # 512 tokens an example: activations are a third of the need (433 kB); in bfloat16, 368 kB.
    ({"dtype": "bfloat16", "seq_len": 512, "vocab_size": 16}, "", 4e5)])
def test_the_memory_check_admits_in_half_precision_what_float32_does_not_hold(fields, mu_dtype,
                                                                              memory):
  half = costs_lib.ModelCosts.from_spec(models.spec("gpt", {**GPT_KW, **fields}), 1.0, mu_dtype)
  f32 = dataclasses.replace(half, nbytes=costs_lib.StateBytes())
  cluster = cluster_lib.Cluster(np.ones(2), memory, np.full((2, 2), 1e-5), np.full((2, 2), 1e9))
  with pytest.raises(ValueError, match="cluster.memory: no plan fits"):
    search.plan(f32, cluster, 4, (1, 2, 4))
  plan = search.plan(half, cluster, 4, (1, 2, 4))
  assert plan.breakdown["memory_ok"] and max(plan.breakdown["memory_bytes"]) <= memory
  assert not predict.predict(plan, f32, cluster)["memory_ok"]       # the same plan in float32


def test_bad_requests_name_the_argument():
  cluster = two_regions()
  for kw, name in [(dict(global_batch=0), "global_batch"),
                   (dict(microbatch_sizes=(3,)), "microbatch_sizes"),
                   (dict(schedules=("zb",)), "schedules"), (dict(syncs=("gossip",)), "syncs"),
                   (dict(method="random"), "method")]:
    args = dict(global_batch=32, microbatch_sizes=(1,), schedules=("gpipe",), syncs=("sync",),
                method="auto")
    args.update(kw)
    with pytest.raises(ValueError, match=name):
      search.plan(GPT_COSTS, cluster, **args)


def test_a_large_cluster_gets_a_plan_that_fits_and_beats_the_even_pipeline():
  # 256 devices of 8 types over 4 regions; how long the search takes is a benchmark's
  # (docs/benchmarks.md reports 1,024 devices of 16 types).
  speeds = np.linspace(1.0, 0.3, 8)
  regions = [list(np.repeat(speeds[2 * r:2 * r + 2], 32)) for r in range(4)]
  cluster = cluster_lib.Cluster.two_level(regions, intra=(1e-5, 2.5e10), inter=(2e-2, 1.25e9),
                                          memory=8e10)
  plan = search.plan(GPT_COSTS, cluster, 1024, (1, 2, 4))
  assert plan.num_devices == 256 and plan.breakdown["memory_ok"]
  assert plan.predicted_s < baselines.even_pipeline(GPT_COSTS, cluster, 1024, (1, 2, 4)).predicted_s
  assert request.as_request(GPT_COSTS, cluster, 1024).num_devices == 256
