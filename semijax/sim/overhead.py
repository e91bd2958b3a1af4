"""What balancing itself costs at scale: the controller's time and the speed samples' bytes.

Per cluster size (`measure`):

  decide_ms           mean host milliseconds of one `Controller.decide` of one stage, timed in a
                      simulated `semi` run (the library's code, on this machine's CPU), and
                      per step (decisions every `probe_every` steps, one per pipeline stage);
  tensor_times_ms     one call of `balance.speed.tensor_times` (each tensor position's slowest
                      replica, a loop over every device) on a mesh of that size;
  tracker_ms          one `SpeedTracker.update` of a stage (tensor positions only);
  sample_bytes        what every process receives per speed sample: beyond
                      `sampling.KV_MAX_PROCESSES` processes, `speed.gather_times` all-gathers,
                      from each of P processes, a float64 array of (its devices + 1) x 2 entries
                      (device id and time, plus one row for the step time): P x (devices per
                      process + 1) x 16 bytes; with fewer, every process reads every process's
                      JSON record from the key-value store (`sampling.KeyValueGather`: P records
                      of about 30 bytes per device: its id and its time, a float64 written with
                      its full 17 digits);
  planner             the library's partition and placement planner (`semijax.planner`) on the
                      same devices (`sim.planning`): the run's model and global batch, each
                      device at its mean speed over the `semi` run, the cluster's links (NVLink
                      inside a node, InfiniBand between nodes, the region link between regions):
                      {"seconds": one `search.plan` call, "cluster_s": building the planner's
                      `Cluster` (its device classes), "mesh", "stage_layers", "predicted_s"};
                      None above `planner_max` devices.

The numbers are independent of the hardware profile except `decide_ms`, which depends on the
model's unit counts (the controller's split search runs over units), and the planner's, whose
choices and pruning follow the model's and links' costs.
"""

from __future__ import annotations

import json
import time
import types

import numpy as np

from semijax.balance import sampling as sampling_lib
from semijax.balance import speed as speed_lib
from semijax.core import mesh as mesh_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import planning
from semijax.sim import simulator
from semijax.sim import study as study_lib

DEVICES_PER_PROCESS = 8      # one process per host of 8 accelerators (jax.distributed's usual)
FLOAT64 = 8


def sample_bytes(devices: int, per_process: int = DEVICES_PER_PROCESS) -> int:
  """Bytes every process receives per shared speed sample (see module doc)."""
  processes = max(1, devices // per_process)
  if processes <= 1:
    return 0
  if processes <= sampling_lib.KV_MAX_PROCESSES:      # KeyValueGather's record, per process
    # Measured times print all their digits; the last process's ids are the widest.
    record = json.dumps([1 / 3, [[devices - 1 - i, 1 / 3 + i / 7] for i in range(per_process)]])
    return processes * len(record)
  return processes * (per_process + 1) * 2 * FLOAT64


def _mesh(devices: int, tensor: int):
  """A stand-in for a `jax.sharding.Mesh` of `devices` (ids 0..D-1) with a `tensor` axis: what
  `speed.tensor_times` reads of one."""
  ids = np.array([types.SimpleNamespace(id=i) for i in range(devices)], object)
  return types.SimpleNamespace(devices=ids.reshape(devices // tensor, tensor),
                               axis_names=(mesh_lib.DATA, mesh_lib.TENSOR))


def _timed(fn, repeats: int) -> float:
  fn()
  t0 = time.perf_counter()
  for _ in range(repeats):
    fn()
  return (time.perf_counter() - t0) / repeats


def planner_cost(run: simulator.Run, speeds: np.ndarray) -> dict:
  """The planner's row entry (module doc) for `run`'s devices at `speeds` float [D]."""
  t0 = time.perf_counter()
  cluster = planning.planner_cluster(run.cluster, run.hardware, speeds)
  t1 = time.perf_counter()
  plan = planning.plan(run, speeds, cluster)
  t2 = time.perf_counter()
  return {"seconds": t2 - t1, "cluster_s": t1 - t0, "mesh": [plan.data, plan.pipe, plan.tensor],
          "stage_layers": list(plan.stage_layers), "microbatch_size": plan.microbatch_size,
          "schedule": plan.schedule, "predicted_s": plan.predicted_s}


def measure(hw: hardware_lib.Hardware, sizes=study_lib.SIZES, steps: int = 200,
            scenario: str = "rotating", seed: int = 0, pipe: int = study_lib.PIPE,
            planner_max: int = max(study_lib.SIZES)) -> list[dict]:
  """One row per cluster size (see module doc), from a `semi` run of `steps` under `scenario`;
  the planner is timed up to `planner_max` devices."""
  rows = []
  for devices in sizes:
    base = study_lib.base_run(devices, scenario, hw, steps, seed, pipe)
    trace = study_lib.trace_for(base, scenario, seed=seed)
    r = simulator.simulate(base.with_policy("semi"), trace)
    decisions = max(r.stat("decisions"), 1)
    times = {i: float(t) for i, t in enumerate(np.random.default_rng(seed).random(devices) + 1)}
    mesh = _mesh(devices, base.cluster.tensor)
    tracker = speed_lib.SpeedTracker(base.cluster.tensor)
    sample = np.ones(base.cluster.tensor)
    planner = (planner_cost(base, planning.mean_speeds(trace, r.step_s))
               if devices <= planner_max else None)
    rows.append({
        "devices": devices, "stages": base.cluster.pipe,
        "decide_ms": 1e3 * r.stat("decide_s") / decisions,
        "decide_ms_per_step": 1e3 * r.stat("decide_s") / steps,
        "decisions": int(r.stat("decisions")), "migrations": int(r.stat("migrations")),
        "step_s": float(r.step_s.mean()),
        "tensor_times_ms": 1e3 * _timed(lambda: speed_lib.tensor_times(mesh, times), 5),
        "tracker_ms": 1e3 * _timed(lambda: tracker.update(sample, 1.0), 200),
        "processes": max(1, devices // DEVICES_PER_PROCESS),
        "sample_bytes": sample_bytes(devices), "simulated_s": r.wall_s, "planner": planner})
  return rows


def _planner_cells(planner: dict | None) -> str:
  """The markdown cells of a row's planner entry: seconds, cluster seconds, mesh."""
  if planner is None:
    return "not run | – | –"
  mesh = " x ".join(str(x) for x in planner["mesh"])
  return f"{planner['seconds']:.2f} | {planner['cluster_s']:.2f} | {mesh}"


def markdown(rows: list[dict]) -> str:
  lines = ["| devices | processes | decide ms (one stage) | decide ms per step (all stages) "
           "| decide / step time | tensor_times ms | tracker ms | bytes per process per sample "
           "| simulation s | planner s | planner's cluster s | planned mesh d x p x t |",
           "|---" * 12 + "|"]
  for x in rows:
    lines.append(
        f"| {x['devices']} | {x['processes']} | {x['decide_ms']:.2f} "
        f"| {x['decide_ms_per_step']:.2f} | {x['decide_ms_per_step'] / 1e3 / x['step_s']:.2%} "
        f"| {x['tensor_times_ms']:.2f} | {x['tracker_ms']:.3f} | {x['sample_bytes']:,} "
        f"| {x['simulated_s']:.1f} | {_planner_cells(x['planner'])} |")
  return "\n".join(lines) + "\n"
