"""Plans that leave devices idle: on clusters with failing devices the planner predicts exactly
the least step time of an exhaustive search that may leave any devices out (`brute_force`); a
failing device costs a plan nothing; a device too small to hold anything is left out instead of
failing the request; and a plan's idle devices are checked, shown and saved."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import brute_force
from semijax import errors
from semijax import models
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import hierarchy
from semijax.planner import plan as plan_lib
from semijax.planner import predict
from semijax.planner import search

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The shape of `configs/gpt_tiny.py`'s default variant, byte-level, at the default device rate.
TINY = costs_lib.ModelCosts.from_spec(
    models.spec("gpt", dict(vocab_size=256, seq_len=256, d_model=512, num_heads=16, d_ff=2048,
                            num_layers=6, dtype="bfloat16")), 2.0)
GIB = 2 ** 30


def failing_case(seed):
  """3-5 devices in one region, of which 1-2 fail: they run at 1-3% of the others' speed, or
  (one time in four) hold almost no memory; compute outweighs the links. Returns (costs,
  cluster, batch, a key per device: equal keys are interchangeable devices)."""
  rng = np.random.default_rng(seed)
  n = int(rng.integers(3, 6))
  bad = int(rng.integers(1, 3))
  speeds = [float(rng.choice([1.0, 0.5])) for _ in range(n - bad)]
  memory = [np.inf] * (n - bad)
  for _ in range(bad):
    small = rng.random() < 0.25
    speeds.append(1.0 if small else float(rng.choice([0.01, 0.03])))
    memory.append(1e3 if small else np.inf)
  cluster = cluster_lib.Cluster.from_regions([speeds], [[1e-6]], [[1e10]], [memory])
  costs = costs_lib.ModelCosts(
      num_layers=int(rng.integers(2, 5)), d_model=32, seq_len=16,
      num_units={"mlp": 24, "heads": int(rng.choice([2, 4]))},
      flops_per_unit={"mlp": 128.0, "heads": 4096.0}, unit_params={"mlp": 65, "heads": 512},
      layer_params=192, first_params=2560, last_params=2112, device_gflops=1e-3,
      first_flops=float(rng.choice([0.0, 300.0])), last_flops=float(rng.choice([0.0, 3000.0])))
  return costs, cluster, int(rng.choice([4, 6])), list(zip(speeds, memory))


@pytest.mark.parametrize("seed", range(8))
def test_the_planner_finds_the_exhaustive_optimum_with_failing_devices(seed):
  costs, cluster, batch, same = failing_case(seed)
  want, best = brute_force.best_plan(costs, cluster, batch, (1, 2), ("gpipe", "1f1b"),
                                     same_devices=same)
  # The optimum leaves a failing device out (else the case would not test idle devices).
  failing = {i for i, (speed, memory) in enumerate(same) if speed < 0.05 or memory < 1e4}
  assert set(best.idle) & failing, best
  plan = search.plan(costs, cluster, batch, (1, 2))
  assert plan.predicted_s == pytest.approx(want, rel=1e-9)
  assert plan.idle and set(plan.idle) <= set(range(cluster.num_devices))
  again = predict.predict(plan, costs, cluster)
  assert again["memory_ok"] and again["step_s"] == pytest.approx(want, rel=1e-12)


def with_failing_device(regions, speed=0.01, memory=16 * GIB):
  """Regions of devices at `regions` speeds (10 us and 25 GB/s inside a region, 20 ms and
  1.25 GB/s between), and the same with one more device, at `speed` and with `memory`, last."""
  kw = dict(intra=(1e-5, 2.5e10), inter=(2e-2, 1.25e9))
  sick = [list(r) for r in regions[:-1]] + [list(regions[-1]) + [speed]]
  memory_sick = [[16 * GIB] * len(r) for r in regions[:-1]] + [
      [16 * GIB] * len(regions[-1]) + [memory]]
  return (cluster_lib.Cluster.two_level(regions, memory=16 * GIB, **kw),
          cluster_lib.Cluster.two_level(sick, memory=memory_sick, **kw))


@pytest.mark.parametrize("regions, method", [
    ([[1.0] * 7], "auto"), ([[1.0] * 7], "hierarchical"),
    ([[1.0] * 4 + [0.5] * 4, [0.7] * 8], "hierarchical"),
    ([[1.0] * 16, [0.5] * 16], "auto")])
def test_a_failing_device_costs_the_plan_nothing(regions, method):
  healthy, sick = with_failing_device(regions)
  want = search.plan(TINY, healthy, 64, (1, 2), method=method)
  got = search.plan(TINY, sick, 64, (1, 2), method=method)
  assert got.idle == (healthy.num_devices,) and got.num_devices == sick.num_devices
  assert got.predicted_s == pytest.approx(want.predicted_s, rel=1e-12)
  assert got.device_order == want.device_order


def test_a_device_too_small_for_any_stage_is_left_out():
  healthy, sick = with_failing_device([[1.0] * 3], speed=1.0, memory=1e6)
  want = search.plan(TINY, healthy, 64, (1, 2))
  got = search.plan(TINY, sick, 64, (1, 2))
  assert got.idle == (3,) and got.predicted_s == pytest.approx(want.predicted_s, rel=1e-12)
  # Where no choice of devices holds the model, the request still fails by name.
  tiny = cluster_lib.Cluster(np.ones(2), 1e6, np.full((2, 2), 1e-5), np.full((2, 2), 1e9))
  with pytest.raises(errors.ConfigError, match="cluster.memory: no plan fits"):
    search.plan(TINY, tiny, 64, (1, 2))


def test_the_hierarchical_search_leaves_out_the_slowest_devices_first():
  speeds, memory = [0.5, 1.0, 0.01, 1.0, 0.5, 0.01], [8e9, 8e9, 8e9, 4e9, 8e9, 8e9]
  c = cluster_lib.Cluster(speeds, memory, np.full((6, 6), 1e-5), np.full((6, 6), 1e9))
  sets = [d.tolist() for d in hierarchy.device_sets(c)]
  assert sets == [[0, 1, 2, 3, 4, 5], [0, 1, 3, 4], [1, 3], [1]]


PLAN = dict(data=1, pipe=1, tensor=2, device_order=(2, 0), stage_layers=(3,),
            stage_units=({"mlp": (3, 1), "heads": (1, 1)},), microbatches=(2,), microbatch_size=1,
            idle=(3, 1))


def test_idle_devices_are_checked_counted_and_saved():
  plan = plan_lib.Plan(**PLAN)
  assert plan.idle == (1, 3) and plan.num_devices == 4 and plan.mesh_devices == 2
  saved = json.loads(json.dumps(plan.to_dict()))
  assert saved["idle"] == [1, 3]
  assert plan_lib.Plan(**{k: v for k, v in saved.items() if k != "predicted_s"}) == plan
  assert plan_lib.Plan(**{**PLAN, "device_order": (0, 1), "idle": ()}).num_devices == 2
  for field, change in [("device_order", dict(idle=(2, 3))), ("device_order", dict(idle=(4,))),
                        ("device_order", dict(idle=(-1, 1))), ("idle", dict(idle=3)),
                        ("idle", dict(idle=(1.0, 3)))]:
    with pytest.raises(errors.ConfigError, match=f"plan.{field}"):
      plan_lib.Plan(**{**PLAN, **change})


def test_the_printed_plan_lists_idle_devices():
  plan = plan_lib.Plan(**PLAN)
  speeds, regions = np.array([1.0, 0.01, 1.0, 0.5]), np.array([0, 0, 1, 1])
  lines = plan_lib.describe(plan, regions, speeds=speeds).splitlines()
  assert lines[1] == "idle devices: 1@0 (speed 0.01), 3@1 (speed 0.5)"
  assert "idle devices: 1 3" in plan_lib.describe(plan)
  busy = plan_lib.Plan(**{**PLAN, "device_order": (1, 0), "idle": ()})
  assert "idle" not in plan_lib.describe(busy, regions, speeds=speeds)
  many = plan_lib.Plan(**{**PLAN, "idle": tuple(range(1, 12)) + (13,), "device_order": (0, 12)})
  assert (plan_lib.idle_line(many, speeds=np.ones(14)) ==
          "idle devices: 1 2 3 4 5 6 7 8 and 4 more (speed 1)")


def test_predict_names_a_cluster_of_another_size():
  plan = plan_lib.Plan(**PLAN)
  costs = costs_lib.ModelCosts(num_layers=3, d_model=2, seq_len=1,
                               num_units={"mlp": 4, "heads": 2},
                               flops_per_unit={"mlp": 1e9, "heads": 2e9},
                               unit_params={"mlp": 10, "heads": 100}, layer_params=6,
                               first_params=50, last_params=70, device_gflops=1.0)
  small = cluster_lib.Cluster(np.ones(3), np.inf, np.zeros((3, 3)), np.ones((3, 3)))
  with pytest.raises(ValueError, match="plan: places 2 devices and leaves 2 idle, the cluster "
                                       "has 3"):
    predict.predict(plan, costs, small)
  # On the right cluster the idle devices hold nothing.
  four = cluster_lib.Cluster([1.0, 0.01, 1.0, 0.5], np.inf, np.zeros((4, 4)), np.ones((4, 4)))
  out = predict.predict(plan, costs, four)
  assert out["memory_bytes"][1] == out["memory_bytes"][3] == 0.0
  assert min(out["memory_bytes"][0], out["memory_bytes"][2]) > 0


def run_plan(tmp_path, cluster):
  out = tmp_path / "plan.json"
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "plan.py"),
       "--config", os.path.join(ROOT, "configs", "gpt_tiny.py"), f"--cluster={cluster}",
       "--intra=1e-5,2.5e10", "--microbatch_sizes=1,2", f"--out={out}"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  return run.stdout, json.load(open(out))


@pytest.mark.slow
def test_plan_entry_point_shows_and_saves_idle_devices(tmp_path):
  out, saved = run_plan(tmp_path, "3x1.0@16G,1x0.01@16G")
  assert out.splitlines()[2] == "idle devices: 3@0 (speed 0.01)"
  assert saved["idle"] == [3] and saved["cluster"]["devices"] == 4
  healthy_out, healthy = run_plan(tmp_path, "3x1.0@16G")
  assert "idle" not in healthy_out and healthy["idle"] == []
  assert saved["predicted_s"] == pytest.approx(healthy["predicted_s"], rel=1e-12)
