"""The partition and placement planner's benchmark: predicted steps against the baselines, the
planner's own time at 64 to 1,024 devices, and how close its hierarchical search comes to the
exact optimum on small clusters.

Clusters: `devices` devices of `types` device types spread evenly over `regions` regions (each
region holds types / regions types, equally many devices of each). Type k runs at speed
1 - 0.75 k / (types - 1) (1.0 down to 0.25) and holds 80, 48, 40 or 24 GiB by speed quartile.
Links: 10 us and 25 GB/s inside a region; between regions 20 ms and 1.25 GB/s (10 Gbit/s). The
model: a 6.7B-parameter GPT (32 layers, d_model 4,096, 32 heads, d_ff 16,384, 2,048 tokens, a
50,304-token vocabulary) on devices of 300 TFLOP/s at speed 1; 1,024 sequences per step.

Every figure is a prediction of the planner's time model (`semijax.planner.predict`), the same
model the emulation sleeps; the planner's own run time is measured (median of `repeats`).
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from semijax import models
from semijax.planner import baselines
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import exact
from semijax.planner import hierarchy
from semijax.planner import request

GPT_6_7B = dict(vocab_size=50304, seq_len=2048, d_model=4096, num_heads=32, d_ff=16384,
                num_layers=32)
DEVICE_GFLOPS = 300e3
INTRA = (10e-6, 25e9)
INTER = (20e-3, 1.25e9)
GIB = 2 ** 30


def model_costs(fields: dict | None = None, device_gflops: float = DEVICE_GFLOPS):
  return costs_lib.ModelCosts.from_spec(models.spec("gpt", fields or GPT_6_7B), device_gflops)


def make_cluster(devices: int = 1024, types: int = 16, regions: int = 4) -> cluster_lib.Cluster:
  """The module doc's cluster."""
  if types % regions or devices % types:
    raise ValueError(f"types: {types} types must spread evenly over {regions} regions and "
                     f"{devices} devices")
  speeds = np.linspace(1.0, 0.25, types) if types > 1 else np.ones(1)
  memory = np.array([80, 48, 40, 24])[np.arange(types) * 4 // types] * GIB
  per_type = devices // types
  per_region = types // regions
  region_speeds, region_memory = [], []
  for r in range(regions):
    ks = np.arange(r, types, regions)[:per_region]     # every region gets fast and slow types
    region_speeds.append(np.repeat(speeds[ks], per_type).tolist())
    region_memory.append(np.repeat(memory[ks], per_type).astype(float).tolist())
  return cluster_lib.Cluster.two_level(region_speeds, INTRA, INTER, region_memory)


def compare(costs, cluster, global_batch: int, microbatch_sizes=(1, 2, 4)) -> dict:
  """{baseline: {predicted_s, mesh, ..., plan}} and the planner's own seconds."""
  out = {}
  for name, fn in baselines.BASELINES.items():
    start = time.perf_counter()
    plan = fn(costs, cluster, global_batch, microbatch_sizes)
    b = plan.breakdown
    out[name] = {"predicted_s": plan.predicted_s, "mesh": [plan.data, plan.pipe, plan.tensor],
                 "microbatch_size": plan.microbatch_size, "schedule": plan.schedule,
                 "stage_layers": list(plan.stage_layers),
                 "microbatches": sorted(set(plan.microbatches)),
                 "memory_ok": b["memory_ok"], "bubble": b["bubble"],
                 "transfer_s": b["transfer_s"], "tensor_allreduce_s": b["tensor_allreduce_s"],
                 "data_allreduce_s": b["data_allreduce_s"],
                 "seconds": time.perf_counter() - start}
  return out


def planner_seconds(costs, cluster, global_batch: int, microbatch_sizes=(1, 2, 4),
                    repeats: int = 3) -> float:
  """Median wall-clock seconds of `baselines.full` (the planner)."""
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    baselines.full(costs, cluster, global_batch, microbatch_sizes)
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def random_small(rng: np.random.Generator):
  """A request on 4-8 devices of 1-3 speeds in 1-3 regions, small enough for exact search."""
  groups = []
  for _ in range(int(rng.integers(1, 4))):
    k = int(rng.integers(1, 3))
    speeds = rng.choice([1.0, 0.7, 0.5, 0.3], k, replace=False)
    groups.append(np.repeat(speeds, rng.integers(1, 4, k)).tolist())
  n = sum(len(g) for g in groups)
  while n > 8:
    groups[-1].pop()
    groups = [g for g in groups if g]
    n -= 1
  r_ = len(groups)
  lat = np.full((r_, r_), 1e-3) * rng.uniform(0.5, 2.0, (r_, r_))
  bw = np.full((r_, r_), 1e8) * rng.uniform(0.5, 2.0, (r_, r_))
  np.fill_diagonal(lat, 1e-6)
  np.fill_diagonal(bw, 1e10)
  cluster = cluster_lib.Cluster.from_regions(groups, (lat + lat.T) / 2, np.minimum(bw, bw.T))
  fields = dict(vocab_size=256, seq_len=64, d_model=128, num_heads=8, d_ff=256,
                num_layers=int(rng.integers(2, 9)))
  costs = model_costs(fields, float(rng.choice([0.5, 5.0])))
  return request.as_request(costs, cluster, int(rng.choice([8, 16])), (1, 2))


def quality(cases: int, seed: int = 0, max_work: int = 60_000) -> dict:
  """The hierarchical search's predicted step over the exact optimum's, on `cases` random small
  clusters whose exact search prices at most `max_work` (grid, partition) pairs:
  {"gaps": [...], "mean", "max", "optimal_share", "exact_s", "hierarchical_s"}."""
  rng = np.random.default_rng(seed)
  gaps, t_h, t_e = [], 0.0, 0.0
  while len(gaps) < cases:
    req = random_small(rng)
    if req.num_devices < 4 or exact.work(req) > max_work:
      continue
    start = time.perf_counter()
    h = hierarchy.search(req)
    t_h += time.perf_counter() - start
    start = time.perf_counter()
    e = exact.search(req)
    t_e += time.perf_counter() - start
    if h is None or e is None:
      continue
    gaps.append(h.value / e.value - 1.0)
  return {"gaps": gaps, "mean": float(np.mean(gaps)), "max": float(np.max(gaps)),
          "optimal_share": float(np.mean(np.asarray(gaps) < 1e-9)), "hierarchical_s": t_h,
          "exact_s": t_e}


def run(sizes=(64, 256, 1024), types: int = 16, regions: int = 4, global_batch: int = 1024,
        microbatch_sizes=(1, 2, 4), repeats: int = 3, quality_cases: int = 20,
        fields: dict | None = None, quality_work: int = 60_000) -> dict:
  """The whole benchmark: per size the baselines' predicted steps and the planner's time; the
  quality of the hierarchical search on small clusters."""
  costs = model_costs(fields)
  result = {"sizes": {}, "types": types, "regions": regions, "global_batch": global_batch,
            "microbatch_sizes": list(microbatch_sizes), "model": fields or GPT_6_7B,
            "device_gflops": DEVICE_GFLOPS, "intra": INTRA, "inter": INTER}
  for n in sizes:
    cluster = make_cluster(n, min(types, n), regions)
    result["sizes"][str(n)] = {
        "plans": compare(costs, cluster, global_batch, microbatch_sizes),
        "planner_s": planner_seconds(costs, cluster, global_batch, microbatch_sizes, repeats)}
  if quality_cases:
    result["quality"] = quality(quality_cases, max_work=quality_work)
  return result


def table(result: dict) -> str:
  """Markdown: per size and plan the predicted step, its ratio to the planner's, the mesh."""
  lines = ["| devices | plan | predicted step (s) | x planner | mesh d x p x t | microbatch | "
           "schedule | fits |", "|---|---|---|---|---|---|---|---|"]
  for n, entry in result["sizes"].items():
    full = entry["plans"]["full"]["predicted_s"]
    for name, p in entry["plans"].items():
      mesh = " x ".join(str(x) for x in p["mesh"])
      lines.append(f"| {n} | {name} | {p['predicted_s']:.3f} | {p['predicted_s'] / full:.2f} | "
                   f"{mesh} | {p['microbatch_size']} | {p['schedule']} | "
                   f"{'yes' if p['memory_ok'] else 'no'} |")
  lines += ["", "| devices | planner seconds (median) |", "|---|---|"]
  lines += [f"| {n} | {e['planner_s']:.2f} |" for n, e in result["sizes"].items()]
  if "quality" in result:
    q = result["quality"]
    lines += ["", f"Hierarchical search vs exact optimum on {len(q['gaps'])} random small "
              f"clusters (4-8 devices): optimal in {100 * q['optimal_share']:.0f}%, mean gap "
              f"{100 * q['mean']:.2f}%, worst {100 * q['max']:.2f}% (hierarchical "
              f"{q['hierarchical_s']:.2f} s, exact {q['exact_s']:.1f} s in all)."]
  return "\n".join(lines) + "\n"
