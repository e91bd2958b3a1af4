"""An exhaustive search of the plan space, written independently of the planner's search: every
choice of devices to use (the others idle), every (data, pipe, tensor) of them, every assignment
of their ids to mesh positions, every layer partition, every microbatch split, size, schedule
and sync mode, each plan priced by `predict.predict`. Units follow the planner's rule, computed
here with `core.layout.proportional_counts`."""

import itertools

import numpy as np

from semijax.core import layout
from semijax.planner import plan as plan_lib
from semijax.planner import predict


def compositions(total, parts):
  """Every tuple of `parts` integers >= 1 summing to `total`."""
  if parts == 1:
    yield (total,)
    return
  for first in range(1, total - parts + 2):
    for rest in compositions(total - first, parts - 1):
      yield (first,) + rest


def meshes(num_devices, costs):
  for data in range(1, num_devices + 1):
    for pipe in range(1, num_devices + 1):
      if num_devices % (data * pipe):
        continue
      tensor = num_devices // (data * pipe)
      if pipe <= costs.num_layers and tensor <= min(costs.num_units.values()):
        yield data, pipe, tensor


def orders(cluster, same_devices, count):
  """Every sequence of `count` distinct device ids (which devices are used and where); with
  `same_devices` (a key per device that the caller knows makes devices interchangeable) one per
  distinct sequence of keys."""
  ids = range(cluster.num_devices)
  seen = set()
  for perm in itertools.permutations(ids, count):
    key = perm if same_devices is None else tuple(same_devices[i] for i in perm)
    if key not in seen:
      seen.add(key)
      yield perm


def best_plan(costs, cluster, global_batch, microbatch_sizes, schedules, syncs=("sync",),
              same_devices=None):
  """(the least predicted step over every feasible plan, that plan)."""
  best, best_plan_ = np.inf, None
  n = cluster.num_devices
  for used in range(1, n + 1):
    for data, pipe, tensor in meshes(used, costs):
      for perm in orders(cluster, same_devices, used):
        idle = tuple(sorted(set(range(n)) - set(perm)))
        grid = np.asarray(perm).reshape(data, pipe, tensor)
        units = []
        for p in range(pipe):
          slowest = [min(cluster.speeds[grid[d, p, t]] for d in range(data))
                     for t in range(tensor)]
          units.append({k: layout.proportional_counts(u, slowest)
                        for k, u in costs.num_units.items()})
        for layers in compositions(costs.num_layers, pipe):
          for mb in microbatch_sizes:
            m_ = global_batch // mb
            if m_ < data:
              continue
            for sync in syncs:
              splits = (compositions(m_, data) if sync == "sync" else
                        ([(m_ // data,) * data] if m_ % data == 0 else []))
              for micro in splits:
                for sched in schedules:
                  plan = plan_lib.Plan(data, pipe, tensor, perm, layers, units, micro, mb, sched,
                                       sync, idle)
                  out = predict.predict(plan, costs, cluster)
                  if out["memory_ok"] and out["step_s"] < best:
                    best, best_plan_ = out["step_s"], plan
  return best, best_plan_
