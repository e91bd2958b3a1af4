r"""Plan a model on a heterogeneous cluster: print the plan, its predicted step and write JSON.

The model, the global batch and the nominal device rate come from a training config (its
`model.*`, `batch_size` and `hetero.device_gflops`); the cluster from --cluster (regions of
devices) with --intra/--inter or --region_latency_s/--region_bandwidth links, or from
--cluster_json (per-device speeds, memory and per-pair links, as `Cluster.to_dict` writes them),
or from the config's `hetero.device_speeds`, `hetero.links.regions`, `hetero.links.latency_s`,
`hetero.links.bandwidth` and `hetero.device_memory_gb` where the config sets them (the fields a
planned training run, `config.plan = "auto"`, emulates). Microbatch sizes and schedules default
to the config's `planner.microbatch_sizes` (() or absent: every divisor of the global batch)
and `planner.schedules`.

  python experiments/plan.py --config configs/gpt_tiny.py \
      --cluster='4x1.0@16G,4x0.5@16G;8x0.7@8G' --intra=1e-5,2.5e10 --inter=2e-2,1.25e9 \
      --microbatch_sizes=1,2,4 --baselines

--cluster: regions separated by ';', each a ','-separated list of COUNTxSPEED[@MEMORY] groups
(MEMORY in bytes, or with a K/M/G/T suffix in powers of 1024; unbounded without). Links: --intra
and --inter as LATENCY_S,BYTES_PER_S, or R x R matrices as rows separated by ';'
(--region_latency_s='1e-5,2e-2;2e-2,1e-5').

The plan is printed readably (devices per stage, layers, unit splits, microbatches, the step's
parts; a plan that leaves devices idle lists them with their speeds on a line
`idle devices: ...` after the mesh) and written to --out: the plan's fields at the top level
(what `config.plan = PATH` loads; `idle` lists the devices left out), with the request, model,
cluster and planner time beside them; --baselines adds the
Megatron-style, even-pipeline and compute-only plans (`semijax.planner.baselines`) and their
predicted steps.
"""

import json
import os
import re
import time

from absl import app
from absl import flags
from ml_collections import config_flags
import numpy as np

from semijax import errors
from semijax import models
from semijax.planner import baselines
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import plan as plan_lib
from semijax.planner import search
from semijax.runtime import cli
from semijax.train import config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training configuration file (the "
                                          "model, batch_size, hetero.device_gflops).")
_CLUSTER = flags.DEFINE_string("cluster", None, "Regions of devices: 'COUNTxSPEED[@MEMORY],...;"
                               "...' (module doc).")
_CLUSTER_JSON = flags.DEFINE_string("cluster_json", None, "A JSON file with speeds, memory, "
                                    "latency_s, bandwidth (and regions) per device.")
_INTRA = flags.DEFINE_string("intra", "1e-5,2.5e10", "Link inside a region: latency s,bytes/s.")
_INTER = flags.DEFINE_string("inter", "2e-2,1.25e9", "Link between regions: latency s,bytes/s.")
_REGION_LATENCY = flags.DEFINE_string("region_latency_s", None, "R x R latencies, rows ';'.")
_REGION_BANDWIDTH = flags.DEFINE_string("region_bandwidth", None, "R x R bandwidths, rows ';'.")
_BATCH = flags.DEFINE_integer("global_batch", None, "Examples per step (default: batch_size).")
_GFLOPS = flags.DEFINE_float("device_gflops", None, "GFLOP/s at speed 1 (default: the config's "
                             "hetero.device_gflops).")
_SIZES = flags.DEFINE_list("microbatch_sizes", None, "Examples per microbatch to choose from "
                           "(default: the config's planner.microbatch_sizes).")
_SCHEDULES = flags.DEFINE_list("schedules", None, "Pipeline schedules (default: the config's "
                               "planner.schedules, else gpipe and 1f1b).")
_SYNCS = flags.DEFINE_list("syncs", ["sync"], "Data-parallel sync modes (sync, ssaw, async, "
                           "local_sgd).")
_METHOD = flags.DEFINE_enum("method", "auto", list(search.METHODS), "Exact, hierarchical or auto.")
_BASELINES = flags.DEFINE_bool("baselines", False, "Also plan and print the baselines.")
_PIPELINES = flags.DEFINE_integer("show_pipelines", 4, "Pipelines listed per stage.")
_OUT = flags.DEFINE_string("out", "results/plan/plan.json", "Where the JSON goes.")
flags.mark_flags_as_required(["config"])

_UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
_GROUP = re.compile(r"^\s*(\d+)\s*x\s*([0-9.eE+-]+)\s*(?:@\s*([0-9.eE+-]+)\s*([KMGT]?))?\s*$")


def parse_regions(text: str) -> tuple[list, list]:
  """'COUNTxSPEED[@MEMORY],...;...' -> (per region speeds, per region memory in bytes)."""
  speeds, memory = [], []
  for r, region in enumerate(text.split(";")):
    s, m = [], []
    for group in region.split(","):
      match = _GROUP.match(group)
      if not match:
        raise errors.ConfigError(f"--cluster: region {r}: {group!r} is not COUNTxSPEED[@MEMORY]"
                                 " (e.g. 8x0.5@16G)")
      count, speed = int(match[1]), float(match[2])
      mem = float(match[3]) * _UNITS[match[4]] if match[3] else np.inf
      s += [speed] * count
      m += [mem] * count
    speeds.append(s)
    memory.append(m)
  return speeds, memory


def parse_matrix(text: str, name: str) -> np.ndarray:
  try:
    return np.asarray([[float(x) for x in row.split(",")] for row in text.split(";")])
  except ValueError:
    raise errors.ConfigError(f"--{name}: {text!r} is not rows of numbers separated by ';'") \
        from None


def parse_link(text: str, name: str) -> tuple[float, float]:
  values = parse_matrix(text, name).reshape(-1)
  if len(values) != 2:
    raise errors.ConfigError(f"--{name}: need LATENCY_S,BYTES_PER_S, got {text!r}")
  return float(values[0]), float(values[1])


def build_cluster(config) -> cluster_lib.Cluster:
  """The cluster from --cluster_json, --cluster or the config's hetero fields (module doc)."""
  if _CLUSTER_JSON.value:
    with open(_CLUSTER_JSON.value) as f:
      d = json.load(f)
    return cluster_lib.Cluster(d["speeds"], d.get("memory", np.inf), d["latency_s"],
                               d["bandwidth"], d.get("regions"))
  if _CLUSTER.value:
    speeds, memory = parse_regions(_CLUSTER.value)
    if _REGION_LATENCY.value or _REGION_BANDWIDTH.value:
      if not (_REGION_LATENCY.value and _REGION_BANDWIDTH.value):
        raise errors.ConfigError("--region_latency_s and --region_bandwidth go together")
      return cluster_lib.Cluster.from_regions(
          speeds, parse_matrix(_REGION_LATENCY.value, "region_latency_s"),
          parse_matrix(_REGION_BANDWIDTH.value, "region_bandwidth"), memory)
    return cluster_lib.Cluster.two_level(speeds, parse_link(_INTRA.value, "intra"),
                                         parse_link(_INTER.value, "inter"), memory)
  hetero = config.get("hetero", {})
  if "device_speeds" in hetero and config_lib.parse_numbers(hetero.device_speeds,
                                                            "config.hetero.device_speeds"):
    speeds = config_lib.parse_numbers(hetero.device_speeds, "config.hetero.device_speeds")
    links = hetero.get("links", {})
    regions = [int(r) for r in config_lib.parse_numbers(links.get("regions", ()),
                                                        "config.hetero.links.regions")]
    regions = regions or [0] * len(speeds)
    count = max(regions) + 1
    lat = region_matrix(links.get("latency_s", ()), count, "config.hetero.links.latency_s", 0.0)
    bw = region_matrix(links.get("bandwidth", ()), count, "config.hetero.links.bandwidth", np.inf)
    memory = float(hetero.get("device_memory_gb", 0.0)) * 1e9 or np.inf
    return cluster_lib.Cluster.from_device_regions(speeds, regions, lat, bw, memory)
  raise errors.ConfigError("--cluster: describe the cluster (--cluster or --cluster_json); the "
                           "config has no hetero.device_speeds")


def region_matrix(value, count: int, field: str, default: float) -> np.ndarray:
  """A config's region links: () (the default everywhere), (inside, between), or R x R values
  row by row."""
  values = config_lib.parse_numbers(value, field)
  if not values:
    return np.full((count, count), default)
  if len(values) == 2:
    return np.where(np.eye(count, dtype=bool), values[0], values[1])
  if len(values) != count * count:
    raise errors.ConfigError(f"{field}: {len(values)} values for {count} regions; give (inside, "
                             f"between) or {count} x {count} row by row")
  return np.asarray(values).reshape(count, count)


def summary(plan: plan_lib.Plan) -> dict:
  b = plan.breakdown
  return {"predicted_s": plan.predicted_s, "mesh": [plan.data, plan.pipe, plan.tensor],
          "microbatch_size": plan.microbatch_size, "schedule": plan.schedule,
          "memory_ok": b["memory_ok"], "data_allreduce_s": b["data_allreduce_s"],
          "slowest_pipeline_s": max(b["pipeline_s"])}


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  with cli.one_line_errors():
    config = _CONFIG.value
    spec = models.spec(config.model.name, {k: v for k, v in config.model.items()
                                           if k != "name"})
    gflops = _GFLOPS.value or float(config.hetero.device_gflops)
    costs = costs_lib.ModelCosts.from_spec(spec, gflops, config.optimizer.mu_dtype)
    cluster = build_cluster(config)
    batch = _BATCH.value or int(config.batch_size)
    planner_cfg = config.get("planner", {})
    sizes = [int(x) for x in (_SIZES.value or config_lib.parse_numbers(
        planner_cfg.get("microbatch_sizes", ()), "config.planner.microbatch_sizes"))]
    sizes = sizes or [m for m in range(1, batch + 1) if batch % m == 0]
    schedules = list(_SCHEDULES.value or planner_cfg.get("schedules", ("gpipe", "1f1b")))
    args = (costs, cluster, batch, sizes, schedules, _SYNCS.value)
    start = time.perf_counter()
    plan = search.plan(*args, method=_METHOD.value)
    seconds = time.perf_counter() - start
    print(f"{cluster.num_devices} devices in {len(set(cluster.regions.tolist()))} regions, "
          f"{len(set(cluster.classes().tolist()))} device classes; planned in {seconds:.2f} s")
    print(plan_lib.describe(plan, cluster.regions, _PIPELINES.value, cluster.speeds))
    out = {**plan.to_dict(), "planner_s": seconds, "model": costs.to_dict(),
           "request": {"global_batch": batch, "microbatch_sizes": sizes, "schedules": schedules,
                       "syncs": list(_SYNCS.value), "method": _METHOD.value},
           "cluster": {"devices": cluster.num_devices, "regions": cluster.regions.tolist(),
                       "speeds": cluster.speeds.tolist(), "classes": cluster.classes().tolist()}}
    if _BASELINES.value:
      out["baselines"] = {}
      print("\nbaseline         predicted step (s)   x the planner   mesh (data, pipe, tensor)")
      for name, fn in baselines.BASELINES.items():
        other = plan if name == "full" else fn(*args)
        out["baselines"][name] = {**summary(other), "plan": other.to_dict()}
        fits = "" if other.breakdown["memory_ok"] else "  (does not fit in memory)"
        print(f"{name:15s} {other.predicted_s:18.6g} {other.predicted_s / plan.predicted_s:14.2f}"
              f"   {other.data} x {other.pipe} x {other.tensor}{fits}")
    os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
    with open(_OUT.value, "w") as f:
      json.dump(out, f, indent=1, default=float)
    print(f"\nwrote {_OUT.value}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
