"""The library's partition and placement planner (`semijax.planner`, docs/pipeline.md) on the
simulator's clusters.

  model_costs(workload, hw)        the planner's `ModelCosts` of the workload's model at the
                                   profile's FLOP rate (`Hardware.device_flops`).
  planner_cluster(cluster, hw, speeds)
                                   the planner's `Cluster` of a simulated one: device id
                                   (r * pipe + s) * tensor + t as the simulator numbers them, at
                                   its speed (float [D]); links as the simulator prices them:
                                   inside a tensor group (one node) the `tensor` link, between
                                   nodes of one region the slower of `pipe` and `data` (the same
                                   link in the profiles), between regions the `region` link;
                                   regions as the cluster spreads its replicas; `DEVICE_MEMORY`
                                   bytes per device.
  plan(run, speeds)                `search.plan` over the whole cluster (mesh, placement, layers,
                                   units, microbatches, schedule) for the run's global batch,
                                   microbatches of `MICROBATCH_SIZES` examples that divide it:
                                   what `overhead` times.
  stage_layers(run, speeds)        layers per pipeline stage for the run's own mesh and
                                   placement (the study's `planner` column): the planner's layer
                                   search on that grid (`hierarchy.starting_layers`, the best of
                                   them under `evaluate.assess`, then `hierarchy.improve`), for
                                   the run's microbatches under GPipe.
  mean_speeds(trace, step_s)       float [D]: each device's mean speed at the step starts of a
                                   simulated run (`Result.step_s`).

The planner's time model lets faster pipelines take more microbatches (its best split); the
simulator runs the workload's microbatches on every replica, so `stage_layers` takes only the
layers from the planner.
"""

from __future__ import annotations

import numpy as np

from semijax.planner import cluster as planner_cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import evaluate
from semijax.planner import hierarchy
from semijax.planner import plan as plan_lib
from semijax.planner import request as request_lib
from semijax.planner import search
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import simulator
from semijax.sim import traces as traces_lib
from semijax.sim import workload as workload_lib

# An H100 SXM's 80 GB of HBM3 (datasheet), in bytes.
DEVICE_MEMORY = 80e9
# The planner's microbatch sizes (examples) for `plan`, as `benchmarks/planner.py` offers them.
MICROBATCH_SIZES = (1, 2, 4)
# The schedule `stage_layers` prices (the simulator's step is GPipe's, `stepcost`).
SCHEDULE = "gpipe"


def model_costs(workload: workload_lib.Workload,
                hw: hardware_lib.Hardware) -> costs_lib.ModelCosts:
  """The planner's costs of `workload`'s model on devices of `hw.device_flops` at speed 1, in
  its precision."""
  return costs_lib.ModelCosts.from_spec(workload.spec, hw.device_flops / 1e9, workload.mu_dtype)


def _links(cluster: cluster_lib.Cluster, hw: hardware_lib.Hardware):
  """(latency_s, bandwidth) float [D, D] and regions int [D] of the module doc's links."""
  ids = np.arange(cluster.devices)
  node = ids // cluster.tensor
  region = cluster.replica_regions()[ids // (cluster.pipe * cluster.tensor)]
  pipe, data = hw.link("pipe"), hw.link("data")
  between = hardware_lib.Link(max(pipe.latency_s, data.latency_s),
                              min(pipe.bytes_per_s, data.bytes_per_s))
  same_node = node[:, None] == node[None, :]
  same_region = region[:, None] == region[None, :]
  lat, bw = np.empty((ids.size, ids.size)), np.empty((ids.size, ids.size))
  for link, where in ((hw.link("region"), ~same_region), (between, same_region),
                      (hw.link("tensor"), same_node)):
    lat[where], bw[where] = link.latency_s, link.bytes_per_s
  return lat, bw, region


def planner_cluster(cluster: cluster_lib.Cluster, hw: hardware_lib.Hardware,
                    speeds: np.ndarray) -> planner_cluster_lib.Cluster:
  """The planner's cluster of `cluster` with device speeds `speeds` float [D] (module doc)."""
  speeds = np.asarray(speeds, np.float64)
  if speeds.shape != (cluster.devices,):
    raise ValueError(f"sim.planning.speeds: need one speed per device ({cluster.devices}), got "
                     f"shape {speeds.shape}")
  lat, bw, region = _links(cluster, hw)
  return planner_cluster_lib.Cluster(speeds, np.full(cluster.devices, DEVICE_MEMORY), lat, bw,
                                     region)


def global_batch(run: simulator.Run) -> int:
  """Examples per step of `run`: the workload's batch on every replica."""
  return run.workload.batch_per_replica * run.cluster.data


def plan(run: simulator.Run, speeds: np.ndarray,
         cluster: planner_cluster_lib.Cluster | None = None) -> plan_lib.Plan:
  """`search.plan` of `run`'s model on its devices at `speeds` float [D] (module doc);
  `cluster`: the planner's cluster if already built."""
  cluster = cluster or planner_cluster(run.cluster, run.hardware, speeds)
  batch = global_batch(run)
  sizes = tuple(m for m in MICROBATCH_SIZES if batch % m == 0)
  return search.plan(model_costs(run.workload, run.hardware), cluster, batch, sizes)


def stage_layers(run: simulator.Run, speeds: np.ndarray) -> tuple[int, ...]:
  """Layers per stage for `run`'s mesh and placement at speeds float [D] (module doc)."""
  c = run.cluster
  costs = model_costs(run.workload, run.hardware)
  if c.pipe == 1:
    return (costs.num_layers,)
  size = run.workload.batch_per_replica // run.workload.microbatches
  req = request_lib.as_request(costs, planner_cluster(c, run.hardware, speeds),
                               global_batch(run), (size,), (SCHEDULE,))
  grid = np.arange(c.devices).reshape(c.shape)
  gc = evaluate.GridCosts.of(grid, costs, req.cluster, req.tokens(size))
  starts = hierarchy.starting_layers(gc, costs.num_layers)
  values = evaluate.assess(gc, costs, starts, SCHEDULE, req.global_batch // size)
  best = int(np.argmin(values))
  cand = request_lib.Candidate(float(values[best]), grid, tuple(int(x) for x in starts[best]),
                               size, SCHEDULE, "sync")
  return hierarchy.improve(gc, req, cand).layers


def mean_speeds(trace: traces_lib.Trace, step_s: np.ndarray) -> np.ndarray:
  """float [D]: each device's mean speed at the start of every step of a run whose steps took
  `step_s` float [steps] seconds on the simulated clock."""
  trace.reset()
  total, clock = np.zeros(trace.num_devices), 0.0
  for step, s in enumerate(step_s):
    total += trace.at(step, clock)[0]
    clock += float(s)
  trace.reset()
  return total / max(len(step_s), 1)
