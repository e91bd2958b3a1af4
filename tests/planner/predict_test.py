"""The time model of a plan: hand-worked plans, the vectorized search's prices against the
loop-by-loop `predict`, and bad plans named."""

import dataclasses

import numpy as np
import pytest

from semijax import errors
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import evaluate
from semijax.planner import plan as plan_lib
from semijax.planner import predict
from semijax.planner import request
from semijax.planner import search
from semijax.planner import split
from semijax.sync import predict as sync_predict

# Round numbers: 1 token per microbatch at 1 GFLOP/s, so an mlp unit takes 1 s and a head 2 s
# at speed 1; activations are 1 x 2 x 4 = 8 bytes.
COSTS = costs_lib.ModelCosts(num_layers=3, d_model=2, seq_len=1, num_units={"mlp": 4, "heads": 2},
                             flops_per_unit={"mlp": 1e9, "heads": 2e9},
                             unit_params={"mlp": 10, "heads": 100}, layer_params=6,
                             first_params=50, last_params=70, device_gflops=1.0)
# Devices 0, 1 (speeds 1, 0.5) in region 0; 2, 3 (speed 1) in region 1. Inside a region 0.1 s
# and 8 bytes/s, between regions 1 s and 4 bytes/s.
CLUSTER = cluster_lib.Cluster.two_level([[1.0, 0.5], [1.0, 1.0]], intra=(0.1, 8.0),
                                        inter=(1.0, 4.0), memory=[3000.0, [4000.0, 4000.0]])


def test_a_pipeline_by_hand():
  plan = plan_lib.Plan(data=1, pipe=2, tensor=2, device_order=(0, 1, 2, 3), stage_layers=(1, 2),
                       stage_units=({"mlp": (3, 1), "heads": (1, 1)},
                                    {"mlp": (2, 2), "heads": (1, 1)}),
                       microbatches=(2,), microbatch_size=1, schedule="gpipe")
  out = predict.predict(plan, COSTS, CLUSTER)
  # Stage 0: compute max((3 + 2) / 1, (1 + 2) / 0.5) = 6 s; a tensor all-reduce inside region
  # 0: 2 x 0.1 + 2 x 1/2 x 8/8 = 1.2 s; f = 1 x (6 + 2.4) = 8.4, b = 1 x (18 + 4.8) = 22.8.
  # Stage 1: compute 4 s; f = 2 x (4 + 2.4) = 12.8, b = 2 x (12 + 4.8) = 33.6. Boundary: 1 + 8/4.
  np.testing.assert_allclose(out["stage_forward_s"], [8.4, 12.8])
  np.testing.assert_allclose(out["stage_backward_s"], [22.8, 33.6])
  # gpipe, 2 stages x 2 microbatches: ticks (F0 | -), (F1 | F0), (- | F1 B1), (B1 | B0), (B0 | -)
  # compute 8.4, 12.8, 46.4, 33.6, 22.8 and a 3 s transfer in each of the first four.
  assert out["compute_s"] == pytest.approx(124.0)
  assert out["transfer_s"] == pytest.approx(12.0)
  # After the last tick the replicated parameters (50 + 70) are all-reduced over the stages:
  # each position's ring crosses the regions, 2 x 1 s + 2 x 1/2 x 4 x 120 / 4 = 122 s.
  assert out["pipe_allreduce_s"] == pytest.approx(122.0)
  assert out["data_allreduce_s"] == pytest.approx(122.0)      # no data-parallel ring
  assert out["step_s"] == pytest.approx(136.0 + 122.0)
  # Without the all-reduces the ticks take 6, 8, 32, 24, 18.
  assert out["tensor_allreduce_s"] == pytest.approx(124.0 - 88.0)
  assert out["bubble"] == pytest.approx(1 - 2 * 77.6 / (2 * 124.0))
  # Parameters: every device holds 2 layer slots (the most any stage has) of 3 MLP units and 1
  # head (the most any position has) and the per-layer 6, 2 x (3 x 10 + 100 + 6) = 272, and the
  # replicated 120: 392; x 12 bytes, plus (stash + 2) x 8 with gpipe stashing 2 and 1
  # microbatches. Region 0's 3000 bytes do not hold it.
  np.testing.assert_allclose(out["memory_bytes"],
                             [12 * 392 + 4 * 8, 12 * 392 + 4 * 8, 12 * 392 + 3 * 8,
                              12 * 392 + 3 * 8])
  assert not out["memory_ok"] and out["memory_use"] == pytest.approx((12 * 392 + 32) / 3000)


def test_a_pipeline_by_hand_in_half_precision():
  """`test_a_pipeline_by_hand`'s plan with bfloat16 activations (2 bytes a value: 4 bytes per
  microbatch), then also bfloat16 parameters, gradients and moments."""
  plan = plan_lib.Plan(data=1, pipe=2, tensor=2, device_order=(0, 1, 2, 3), stage_layers=(1, 2),
                       stage_units=({"mlp": (3, 1), "heads": (1, 1)},
                                    {"mlp": (2, 2), "heads": (1, 1)}),
                       microbatches=(2,), microbatch_size=1, schedule="gpipe")
  compute = dataclasses.replace(COSTS, nbytes=costs_lib.StateBytes(compute=2))
  out = predict.predict(plan, compute, CLUSTER)
  # A tensor all-reduce: 2 x 0.1 + 2 x 1/2 x 4/8 = 0.7 s. Stage 0: f = 6 + 1.4, b = 18 + 2.8;
  # stage 1: f = 2 x (4 + 1.4), b = 2 x (12 + 2.8). Boundary: 1 + 4/4 = 2 s.
  np.testing.assert_allclose(out["stage_forward_s"], [7.4, 10.8])
  np.testing.assert_allclose(out["stage_backward_s"], [20.8, 29.6])
  # Ticks 7.4, 10.8, 10.8 + 29.6, 29.6, 20.8 and a 2 s transfer in each of the first four.
  assert out["compute_s"] == pytest.approx(109.0)
  assert out["transfer_s"] == pytest.approx(8.0)
  assert out["pipe_allreduce_s"] == pytest.approx(122.0)           # gradients still float32
  np.testing.assert_allclose(out["memory_bytes"], [12 * 392 + 4 * 4] * 2 + [12 * 392 + 3 * 4] * 2)
  assert not out["memory_ok"]
  # bfloat16 storage: the replicated gradients' ring 2 x 1 + 2 x 1/2 x 2 x 120 / 4 = 62 s, and
  # 3 x 2 bytes a parameter: 6 x 392 + 16 = 2368 bytes fit region 0's 3000.
  half = dataclasses.replace(COSTS, nbytes=costs_lib.StateBytes(2, 2, 2, 2, 2))
  out = predict.predict(plan, half, CLUSTER)
  assert out["pipe_allreduce_s"] == pytest.approx(62.0)
  assert out["step_s"] == pytest.approx(109.0 + 8.0 + 62.0)
  np.testing.assert_allclose(out["memory_bytes"], [6 * 392 + 4 * 4] * 2 + [6 * 392 + 3 * 4] * 2)
  assert out["memory_ok"]


def test_half_precision_halves_the_bytes_on_the_wire():
  """Without latencies: a bfloat16 compute dtype halves the tensor all-reduces and the boundary
  transfers, bfloat16 parameters the gradient all-reduces, each alone."""
  free = cluster_lib.Cluster(CLUSTER.speeds, CLUSTER.memory, np.zeros((4, 4)), CLUSTER.bandwidth,
                             CLUSTER.regions)
  nbytes = {"f32": costs_lib.StateBytes(), "compute": costs_lib.StateBytes(compute=2),
            "stored": costs_lib.StateBytes(param=2, grad=2, mu=2, nu=2)}
  for grid in ([[[0, 1], [2, 3]]], [[[0, 2]], [[1, 3]]]):       # (1, 2, 2) and (2, 1, 2)
    gc = {k: evaluate.GridCosts.of(np.asarray(grid), dataclasses.replace(COSTS, nbytes=b), free,
                                   4) for k, b in nbytes.items()}
    f32, compute, stored = gc["f32"], gc["compute"], gc["stored"]
    np.testing.assert_allclose(compute.allreduce_s, f32.allreduce_s / 2)
    np.testing.assert_allclose(compute.send_s, f32.send_s / 2)
    assert compute.act_bytes == f32.act_bytes / 2
    np.testing.assert_array_equal(stored.allreduce_s, f32.allreduce_s)
    params = f32.param_counts(np.ones(len(grid[0])), COSTS)
    assert stored.data_allreduce_s(params) == pytest.approx(f32.data_allreduce_s(params) / 2)
    assert compute.data_allreduce_s(params) == f32.data_allreduce_s(params)
    assert np.all(f32.allreduce_s > 0) and f32.data_allreduce_s(params) > 0


def test_the_embedding_and_head_by_hand():
  """The unsplit edge work: every device of the first stage runs the embedding (1 s per token
  here), of the last the head (4 s), on the group's slowest device; the backward 3x. A head
  worth two layers moves a layer off the last stage."""
  costs = dataclasses.replace(COSTS, num_layers=4, first_flops=1e9, last_flops=4e9)
  free = CLUSTER.without_links()

  def plan(layers):
    return plan_lib.Plan(data=1, pipe=2, tensor=2, device_order=(0, 1, 2, 3),
                         stage_layers=layers, stage_units=({"mlp": (3, 1), "heads": (1, 1)},
                                                           {"mlp": (2, 2), "heads": (1, 1)}),
                         microbatches=(1,), microbatch_size=1, schedule="gpipe")
  out = predict.predict(plan((2, 2)), costs, free)
  # Stage 0: 2 layers x 6 s + 1 s / 0.5 (device 1's speed); stage 1: 2 x 4 s + 4 s.
  np.testing.assert_allclose(out["stage_forward_s"], [14.0, 12.0])
  np.testing.assert_allclose(out["stage_backward_s"], [42.0, 36.0])
  assert out["step_s"] == pytest.approx(14 + 12 + 36 + 42)
  without = predict.predict(plan((2, 2)), dataclasses.replace(costs, first_flops=0.0,
                                                              last_flops=0.0), free)
  assert without["step_s"] == pytest.approx(12 + 8 + 24 + 36)
  # Equal devices, 4 s a layer and a head worth two layers: (3, 1) balances the stages and
  # beats (2, 2) once microbatches overlap.
  heavy = dataclasses.replace(costs, first_flops=0.0, last_flops=8e9)
  equal = cluster_lib.Cluster(np.ones(4), np.inf, np.zeros((4, 4)), np.full((4, 4), np.inf))
  units = {"mlp": (2, 2), "heads": (1, 1)}
  t = {layers: predict.predict(dataclasses.replace(plan(layers), stage_units=(units, units),
                                                   microbatches=(4,)), heavy, equal)["step_s"]
       for layers in ((2, 2), (3, 1))}
  # gpipe: F ticks then B ticks; (2, 2): stages (8, 16) f, (24, 48) b; (3, 1): (12, 12), (36, 36).
  assert t[(2, 2)] == pytest.approx(8 + 4 * 16 + 4 * 48 + 24)
  assert t[(3, 1)] == pytest.approx(12 + 4 * 12 + 4 * 36 + 36)


def test_data_parallel_pipelines_by_hand():
  plan = plan_lib.Plan(data=2, pipe=1, tensor=2, device_order=(0, 1, 2, 3), stage_layers=(3,),
                       stage_units=({"mlp": (2, 2), "heads": (1, 1)},), microbatches=(1, 1),
                       microbatch_size=1, schedule="gpipe")
  out = predict.predict(plan, COSTS, CLUSTER)
  # Pipeline 0 (devices 0, 1): compute max(4, 4 / 0.5) = 8; one tick of F and B:
  # 3 x (8 + 2.4) + 3 x (24 + 4.8) = 117.6. Pipeline 1 (devices 2, 3): 3 x 6.4 + 3 x 16.8.
  np.testing.assert_allclose(out["pipeline_s"], [117.6, 69.6])
  assert out["critical"] == 0
  # Each position's ring joins a device of each region: 2 x 1 s + 2 x 1/2 x 4 x 498 / 4.
  assert out["data_allreduce_s"] == pytest.approx(2.0 + 498.0)
  assert out["step_s"] == pytest.approx(117.6 + 500.0)
  assert not out["memory_ok"]             # 12 x 498 bytes on every device
  ssaw = predict.predict(plan_lib.Plan(**{**plan.__dict__, "sync": "ssaw"}), COSTS, CLUSTER)
  want = sync_predict.predict("ssaw", [117.6, 69.6], comm_s=500.0).batch_s
  assert ssaw["step_s"] == pytest.approx(want)


def random_request(rng, num_devices, layers, nbytes=costs_lib.StateBytes()):
  speeds = rng.choice([1.0, 0.6, 0.3], num_devices)
  regions = np.sort(rng.integers(0, 2, num_devices))
  lat = np.where(regions[:, None] == regions[None], 1e-5, 2e-3)
  bw = np.where(regions[:, None] == regions[None], 1e9, 1e7)
  cluster = cluster_lib.Cluster(speeds, rng.uniform(2e5, 2e6, num_devices), lat, bw, regions)
  costs = costs_lib.ModelCosts(num_layers=layers, d_model=32, seq_len=16,
                               num_units={"mlp": 64, "heads": 4},
                               flops_per_unit={"mlp": 128.0, "heads": 3000.0},
                               unit_params={"mlp": 65, "heads": 1048}, layer_params=192,
                               first_params=2560, last_params=2112, device_gflops=0.05,
                               first_flops=float(rng.choice([0.0, 500.0])),
                               last_flops=float(rng.choice([0.0, 5000.0, 30000.0])),
                               nbytes=nbytes)
  return request.as_request(costs, cluster, 48, (1, 2, 4), syncs=("sync", "ssaw"))


@pytest.mark.parametrize("nbytes", [costs_lib.StateBytes(), costs_lib.StateBytes(2, 4, 4, 2, 4),
                                    costs_lib.StateBytes(2, 2, 2, 2, 2)])
def test_the_search_prices_what_predict_predicts(nbytes):
  rng = np.random.default_rng(0)
  checked = 0
  for trial in range(40):
    req = random_request(rng, int(rng.choice([4, 6, 8])), int(rng.integers(2, 6)), nbytes)
    shape = req.factorizations()[rng.integers(len(req.factorizations()))]
    grid = rng.permutation(req.num_devices).reshape(shape)
    layers = split.compositions(req.costs.num_layers, shape[1])
    layers = tuple(int(x) for x in layers[rng.integers(len(layers))])
    mb = int(rng.choice(req.microbatch_sizes))
    sched, sync = rng.choice(["gpipe", "1f1b"]), rng.choice(["sync", "ssaw"])
    m_ = req.global_batch // mb
    gc = evaluate.GridCosts.of(grid, req.costs, req.cluster, req.tokens(mb))
    value = evaluate.assess(gc, req.costs, np.asarray([layers]), sched, m_, sync)[0]
    if not np.isfinite(value):
      continue
    plan = search.realize(req, request.Candidate(value, grid, layers, mb, sched, sync))
    assert plan.breakdown["memory_ok"]
    assert plan.predicted_s == pytest.approx(value, rel=1e-9)
    # The split priced one partition at a time (long splits) agrees with the table.
    if sync == "sync":
      assert evaluate.best_split(gc, req.costs, layers, sched, m_)[0] + plan.breakdown[
          "data_allreduce_s"] == pytest.approx(value, rel=1e-9)
    checked += 1
  assert checked >= 15


def test_the_lower_bound_holds():
  rng = np.random.default_rng(1)
  for trial in range(30):
    req = random_request(rng, int(rng.choice([4, 6])), int(rng.integers(2, 6)))
    for shape in req.factorizations():
      grid = rng.permutation(req.num_devices).reshape(shape)
      gc = evaluate.GridCosts.of(grid, req.costs, req.cluster, req.tokens(2))
      parts = split.compositions(req.costs.num_layers, shape[1])
      for sync in ("sync", "ssaw"):
        values = evaluate.assess(gc, req.costs, parts, "gpipe", 24, sync)
        assert evaluate.lower_bound(gc, req.costs, 24, sync == "sync") <= values.min() + 1e-12


def test_the_mesh_bound_holds_on_any_devices():
  # No grid of a mesh on any choice of devices has a lower bound (so a plan) under the mesh's.
  rng = np.random.default_rng(2)
  for trial in range(20):
    req = random_request(rng, int(rng.choice([4, 6])), int(rng.integers(2, 6)))
    devices = rng.permutation(req.num_devices)[:int(rng.integers(1, req.num_devices + 1))]
    for shape, bound in req.mesh_bounds(devices).items():
      for _ in range(3):
        grid = rng.permutation(devices).reshape(shape)
        for mb in req.microbatch_sizes:
          gc = evaluate.GridCosts.of(grid, req.costs, req.cluster, req.tokens(mb))
          for sync in req.syncs:
            assert bound <= evaluate.lower_bound(gc, req.costs, req.global_batch // mb,
                                                 sync == "sync") * (1 + 1e-12)


def test_bad_plans_name_the_field():
  ok = dict(data=1, pipe=2, tensor=2, device_order=(0, 1, 2, 3), stage_layers=(1, 2),
            stage_units=({"mlp": (3, 1), "heads": (1, 1)}, {"mlp": (2, 2), "heads": (1, 1)}),
            microbatches=(2,), microbatch_size=1)
  for field, value in [("device_order", (0, 1, 2, 2)), ("stage_layers", (3,)),
                       ("stage_units", ({"mlp": (4,), "heads": (2,)},) * 2),
                       ("microbatches", (0,)), ("schedule", "zb"), ("sync", "gossip"),
                       ("tensor", 0)]:
    with pytest.raises(errors.ConfigError, match=f"plan.{field}"):
      plan_lib.Plan(**{**ok, field: value})
  with pytest.raises(ValueError, match="plan.stage_layers"):
    predict.predict(plan_lib.Plan(**{**ok, "stage_layers": (2, 2)}), COSTS, CLUSTER)
  with pytest.raises(ValueError, match="plan.stage_units"):
    units = ({"mlp": (3, 2), "heads": (1, 1)}, {"mlp": (2, 2), "heads": (1, 1)})
    predict.predict(plan_lib.Plan(**{**ok, "stage_units": units}), COSTS, CLUSTER)
  small = cluster_lib.Cluster.two_level([[1.0, 1.0]], intra=(0.1, 8.0), inter=(1.0, 4.0))
  with pytest.raises(ValueError, match="plan: places 4 devices"):
    predict.predict(plan_lib.Plan(**ok), COSTS, small)
