"""The plans the planner is compared with (docs/pipeline.md), each a `Plan` priced on the real
cluster.

  megatron         even tensor and data parallelism, no pipeline: pipe = 1, devices in id order
                   (tensor groups of consecutive ids, as a launcher fills nodes), even unit
                   split, even microbatches; the tensor size and microbatch size that predict
                   fastest (a user tunes those).
  even_pipeline    an even pipeline with the planner off: devices in id order, equal layers per
                   stage, even unit split, even microbatches; the mesh (pipe >= 2 where the
                   model and cluster allow), microbatch size and schedule that predict fastest.
  compute_only     the planner with device speeds but no network model (as Metis, or HARP
                   without its link costs): planned on the cluster with free links, then priced
                   on the real one.
  full             the planner.

Every function takes the planner's arguments (`search.plan`); a baseline whose every choice
overflows a device's memory is returned anyway, with `breakdown["memory_ok"]` False.
"""

from __future__ import annotations

from typing import Sequence

from semijax.core import layout as layout_lib
from semijax.core import schedule as schedule_lib
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import plan as plan_lib
from semijax.planner import predict as predict_lib
from semijax.planner import request as request_lib
from semijax.planner import search
from semijax.planner import split as split_lib

NAMES = ("megatron", "even_pipeline", "compute_only", "full")


def _key(plan: plan_lib.Plan):
  """Feasible plans first, then the fastest."""
  return (not plan.breakdown["memory_ok"], plan.predicted_s)


def _even_plans(req: request_lib.Request, meshes, schedules) -> list[plan_lib.Plan]:
  out = []
  for data, pipe, tensor in meshes:
    units = tuple(split_lib.even_units(req.costs.num_units, tensor) for _ in range(pipe))
    layers = split_lib.even_layers(req.costs.num_layers, pipe)
    for mb in req.microbatch_sizes:
      m_ = req.global_batch // mb
      if m_ < data:
        continue
      for sched in schedules:
        plan = plan_lib.Plan(data, pipe, tensor, tuple(range(req.num_devices)), layers, units,
                             layout_lib.even_counts(m_, data), mb, sched, "sync")
        out.append(predict_lib.with_prediction(plan, req.costs, req.cluster))
  if not out:
    raise ValueError("global_batch: too small for any mesh of this baseline (every pipeline "
                     "needs a microbatch)")
  return out


def megatron(costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster, global_batch: int,
             microbatch_sizes: Sequence[int] = (1,),
             schedules: Sequence[str] = schedule_lib.SCHEDULES,
             syncs: Sequence[str] = ("sync",)) -> plan_lib.Plan:
  """Even tensor x data parallelism without a pipeline (module doc)."""
  del schedules, syncs
  req = request_lib.as_request(costs, cluster, global_batch, microbatch_sizes)
  meshes = [m for m in req.factorizations() if m[1] == 1]
  return min(_even_plans(req, meshes, ("gpipe",)), key=_key)


def even_pipeline(costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster, global_batch: int,
                  microbatch_sizes: Sequence[int] = (1,),
                  schedules: Sequence[str] = schedule_lib.SCHEDULES,
                  syncs: Sequence[str] = ("sync",)) -> plan_lib.Plan:
  """An even pipeline, the planner off (module doc)."""
  del syncs
  req = request_lib.as_request(costs, cluster, global_batch, microbatch_sizes, schedules)
  meshes = req.factorizations()
  piped = [m for m in meshes if m[1] >= 2]
  return min(_even_plans(req, piped or meshes, req.schedules), key=_key)


def compute_only(costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster, global_batch: int,
                 microbatch_sizes: Sequence[int] = (1,),
                 schedules: Sequence[str] = schedule_lib.SCHEDULES,
                 syncs: Sequence[str] = ("sync",), method: str = "auto") -> plan_lib.Plan:
  """The planner blind to links, priced on the real cluster (module doc)."""
  blind = search.plan(costs, cluster.without_links(), global_batch, microbatch_sizes, schedules,
                      syncs, method)
  return predict_lib.with_prediction(blind, costs, cluster)


def full(costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster, global_batch: int,
         microbatch_sizes: Sequence[int] = (1,),
         schedules: Sequence[str] = schedule_lib.SCHEDULES,
         syncs: Sequence[str] = ("sync",), method: str = "auto") -> plan_lib.Plan:
  """The planner (`search.plan`)."""
  return search.plan(costs, cluster, global_batch, microbatch_sizes, schedules, syncs, method)


BASELINES = {"megatron": megatron, "even_pipeline": even_pipeline, "compute_only": compute_only,
             "full": full}
