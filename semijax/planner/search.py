"""The partition and placement planner: the plan with the least predicted step time.

`plan` searches which devices to use (the others are left idle where that is faster),
(data, pipe, tensor), the device at every mesh position, the layers per stage, the microbatch
size, the schedule and the sync mode; the units per tensor position are split in proportion to
the slowest replica's device at that position, and the microbatches over the pipelines by the
best split (faster pipelines take more). It always runs the hierarchical search (`hierarchy`),
and on clusters small enough (at most `EXACT_WORK` grid and partition pairs before symmetries,
over every choice of devices: `exact.work`) the exact search (`exact`) seeded with its result,
so that small plans are provably optimal under the time model (`predict`). `realize` turns a
search candidate into a `Plan` and prices it with `predict`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from semijax import errors
from semijax.core import schedule as schedule_lib
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import evaluate
from semijax.planner import exact
from semijax.planner import hierarchy
from semijax.planner import plan as plan_lib
from semijax.planner import predict as predict_lib
from semijax.planner import request as request_lib

# The exact search runs when its (grid, partition) pairs before symmetries are at most this.
EXACT_WORK = 50_000
METHODS = ("auto", "exact", "hierarchical")


def realize(req: request_lib.Request, cand: request_lib.Candidate) -> plan_lib.Plan:
  """The `Plan` of a candidate (units and microbatches by the planner's rules), predicted."""
  gc = evaluate.GridCosts.of(cand.grid, req.costs, req.cluster, req.tokens(cand.microbatch_size))
  m_ = req.global_batch // cand.microbatch_size
  _, split = evaluate.best_split(gc, req.costs, cand.layers, cand.schedule, m_, cand.sync)
  r_, s_, n_ = cand.grid.shape
  idle = np.setdiff1d(np.arange(req.num_devices), cand.grid)
  plan = plan_lib.Plan(data=r_, pipe=s_, tensor=n_, device_order=tuple(cand.grid.reshape(-1)),
                       stage_layers=cand.layers, stage_units=gc.units, microbatches=split,
                       microbatch_size=cand.microbatch_size, schedule=cand.schedule,
                       sync=cand.sync, idle=tuple(int(i) for i in idle))
  return predict_lib.with_prediction(plan, req.costs, req.cluster)


def search(req: request_lib.Request, method: str = "auto") -> request_lib.Candidate:
  """The best candidate for `req` (see module doc).

  Raises:
    errors.ConfigError (a ValueError): an unknown method, or no plan fits the devices' memory.
  """
  if method not in METHODS:
    raise errors.ConfigError(f"method: {method!r} is not one of {METHODS}")
  best = hierarchy.search(req)
  if method == "exact" or (method == "auto" and exact.work(req) <= EXACT_WORK):
    best = exact.search(req, incumbent=best)
  if best is None:
    raise errors.ConfigError("cluster.memory: no plan fits the devices' memory (parameters, "
                             "Adam moments and stashed activations); add devices or memory, or "
                             "try smaller microbatch_sizes")
  return best


def plan(costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster, global_batch: int,
         microbatch_sizes: Sequence[int] = (1,),
         schedules: Sequence[str] = schedule_lib.SCHEDULES,
         syncs: Sequence[str] = ("sync",), method: str = "auto") -> plan_lib.Plan:
  """The plan with the least predicted seconds per global batch.

  Args:
    costs: the model (`costs.ModelCosts.from_spec`).
    cluster: the devices and links.
    global_batch: examples per step.
    microbatch_sizes: the examples per microbatch to choose from (each divides global_batch).
    schedules: the pipeline schedules to choose from.
    syncs: the data-parallel sync modes to choose from (`sync.settings.MODES`).
    method: "auto" (exact when small enough), "exact" or "hierarchical".

  Raises:
    errors.ConfigError (a ValueError): a bad argument (named), or no plan fits in memory.
  """
  req = request_lib.as_request(costs, cluster, global_batch, microbatch_sizes, schedules, syncs)
  return realize(req, search(req, method))
