"""The predicted step time of a plan: the time model the planner minimizes and the emulation sleeps.

For a plan with microbatches of `tokens` = microbatch_size x seq_len tokens (`costs` for the
unit_ms and parameter counts, `cluster` for speeds v, memory and links):

  stage compute   the forward of one layer on the tensor group of pipeline d, stage p:
                  c = max over positions t of sum_k unit_ms[k] x units[p][k][t] / v(d, p, t).
  tensor all-red. a = allreduce_s(tokens x d_model x A bytes, N, the group's slowest link), two
                  per layer in the forward; allreduce_s(b, N, L, W) = 0 if N == 1, else
                  2 (N-1) L + 2 (N-1)/N b / W (a ring; the slowest link: the largest latency
                  and the smallest bandwidth over the members' pairs).
  edge compute    e = edge_s[p] / the group's slowest speed: the embedding on the first stage
                  and the final norm, head and loss on the last, run whole by every device of
                  the stage (`costs.ModelCosts.edge_s`).
  per microbatch  f = layers_p (c + 2 a) + e, b = layers_p (3 c + 4 a) + 3 e (the backward
                  recomputes the forward, then does twice its work;
                  `core.schedule.stage_seconds`).
  boundary        p -> p+1 and back, per microbatch: max over t of
                  L + tokens x d_model x A / W over the link (d, p, t) -- (d, p+1, t).
  pipeline d      `core.schedule.step_time(table(schedule, S, M_d), f, b, send, send)`.
  parameters      what the pipelined engine (`core.pipeline`) holds on every device: its
                  stage's block parameters padded to the plan's capacities (the most layers any
                  stage holds x (the most units of each kind any position holds + the
                  per-layer norms and biases)), and the embedding, final norm and head,
                  replicated on every stage.
  all-reduces     after the last tick: the replicated parameters' gradients over each
                  pipeline's stages (for every pipeline d and position t a ring over (d, :, t)
                  of their bytes: allreduce_s(G x first and last parameters, pipe, the ring's
                  slowest link); the slowest), then every gradient over the pipelines (for
                  every position (p, t) a ring over (:, p, t) of G x the device's parameters;
                  the slowest position; 0 with one pipeline).
  step            sync: the slowest pipeline + the all-reduces; ssaw, async, local_sgd:
                  `sync.predict.predict(mode, pipeline seconds, comm_s=all-reduces)`.
  memory          a device holds P + M + V bytes per parameter (the parameter and Adam's two
                  moments) and (in_flight[p] + 2) x tokens x d_model x A bytes of activations
                  (its stash, `core.schedule.in_flight`, and the two ppermute receive buffers).
                  The plan's idle devices hold nothing and take no part in any of the above.

Bytes per value (`costs.StateBytes`, all 4 in float32): A an activation (compute dtype), G a
gradient and P a parameter (param_dtype), M and V Adam's first moment (optimizer.mu_dtype, or
param_dtype) and second (param_dtype).

This module computes it loop by loop, as a reader would by hand; `evaluate` computes the same
numbers vectorized for the search.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from semijax.core import schedule as schedule_lib
from semijax.planner import cluster as cluster_lib
from semijax.planner import costs as costs_lib
from semijax.planner import evaluate
from semijax.planner import plan as plan_lib
from semijax.sync import predict as sync_predict


@functools.lru_cache(maxsize=256)
def _table(schedule: str, num_stages: int, num_microbatches: int) -> np.ndarray:
  """`core.schedule.table`, kept for the next plan of the same shape (read only)."""
  tab = schedule_lib.table(schedule, num_stages, num_microbatches)
  tab.flags.writeable = False
  return tab


def _check(plan: plan_lib.Plan, costs: costs_lib.ModelCosts, cluster: cluster_lib.Cluster):
  if plan.num_devices != cluster.num_devices:
    idle = f" and leaves {len(plan.idle)} idle" if plan.idle else ""
    raise ValueError(f"plan: places {plan.mesh_devices} devices{idle}, the cluster has "
                     f"{cluster.num_devices}")
  if sum(plan.stage_layers) != costs.num_layers:
    raise ValueError(f"plan.stage_layers: {plan.stage_layers} sum to {sum(plan.stage_layers)}, "
                     f"the model has {costs.num_layers} layers")
  for p, units in enumerate(plan.stage_units):
    if set(units) != set(costs.num_units):
      raise ValueError(f"plan.stage_units: stage {p} has kinds {sorted(units)}, the model "
                       f"{sorted(costs.num_units)}")
    for k, counts in units.items():
      if sum(counts) != costs.num_units[k]:
        raise ValueError(f"plan.stage_units: stage {p} splits {sum(counts)} {k} units, the "
                         f"model has {costs.num_units[k]}")


def predict(plan: plan_lib.Plan, costs: costs_lib.ModelCosts,
            cluster: cluster_lib.Cluster) -> dict:
  """The predicted seconds per global batch of `plan` and their parts (see module doc).

  Returns:
    {"step_s": seconds per global batch, "pipeline_s": [R] each pipeline's step,
     "critical": the slowest pipeline, and of it: "compute_s" (the ticks' slowest stage
     compute, tensor all-reduces included), "tensor_allreduce_s" (what those all-reduces add),
     "bubble" (idle share of its stage-time), "transfer_s" (the ticks' slowest boundary
     transfers), "stage_forward_s" / "stage_backward_s" [S] per microbatch;
     "data_allreduce_s" (every gradient all-reduce after the last tick), "pipe_allreduce_s"
     (of it, the replicated parameters' over `pipe`), "memory_bytes" [D] each device's need,
     "memory_use" (the largest need / memory), "memory_ok"}.

  Raises:
    ValueError: the plan does not fit the cluster or the model.
  """
  _check(plan, costs, cluster)
  tokens = plan.microbatch_size * costs.seq_len
  unit_ms = costs.unit_ms(tokens)
  edge_s = costs.edge_s(tokens, plan.pipe)
  act = costs.activation_bytes(tokens)
  grid = plan.grid()
  r_, s_, n_ = grid.shape
  v = cluster.speeds
  capacity = {k: max(max(u[k]) for u in plan.stage_units) for k in costs.kinds}
  per_layer = sum(costs.unit_params[k] * capacity[k] for k in costs.kinds) + costs.layer_params
  shared = costs.first_params + costs.last_params
  params = np.full((s_, n_), max(plan.stage_layers) * per_layer + shared, np.float64)
  pipelines, parts = [], []
  memory = np.zeros(cluster.num_devices)
  for d in range(r_):
    c, e, a = np.zeros(s_), np.zeros(s_), np.zeros(s_)
    send = np.zeros(max(s_ - 1, 0))
    for p in range(s_):
      devs = grid[d, p]
      c[p] = max(sum(unit_ms[k] * plan.stage_units[p][k][t] for k in costs.kinds) / v[i]
                 for t, i in enumerate(devs)) * 1e-3
      e[p] = edge_s[p] / min(v[i] for i in devs)
      a[p] = schedule_lib.allreduce_s(act, n_, *cluster.group_link(devs))
      if p < s_ - 1:
        send[p] = max(schedule_lib.send_s(act, cluster.latency_s[i, j], cluster.bandwidth[i, j])
                      for i, j in zip(devs, grid[d, p + 1]))
    tab = _table(plan.schedule, s_, plan.microbatches[d])
    f, b = schedule_lib.stage_seconds(plan.stage_layers, c, a, e)
    total = schedule_lib.step_time(tab, f, b, send, send)
    compute = schedule_lib.step_time(tab, f, b, 0 * send, 0 * send)
    f0, b0 = schedule_lib.stage_seconds(plan.stage_layers, c, 0 * a, e)
    pipelines.append(total)
    parts.append({"compute_s": compute,
                  "tensor_allreduce_s": compute - schedule_lib.step_time(tab, f0, b0, 0 * send,
                                                                          0 * send),
                  "bubble": schedule_lib.bubble(tab, f, b), "transfer_s": total - compute,
                  "stage_forward_s": f.tolist(), "stage_backward_s": b.tolist()})
    stash = schedule_lib.in_flight(tab)
    for p in range(s_):
      for t in range(n_):
        memory[grid[d, p, t]] = (costs.nbytes.state * params[p, t]
                                 + (stash[p] + evaluate.STASH_BUFFERS) * act)
  pipe_ar = max(schedule_lib.allreduce_s(costs.nbytes.grad * shared, s_,
                                         *cluster.group_link(grid[d, :, t]))
                for d in range(r_) for t in range(n_))
  data_ar = max(schedule_lib.allreduce_s(costs.nbytes.grad * params[p, t], r_,
                                         *cluster.group_link(grid[:, p, t]))
                for p in range(s_) for t in range(n_))
  grads_ar = pipe_ar + data_ar
  if plan.sync == "sync":
    step = max(pipelines) + grads_ar
  else:
    step = sync_predict.predict(plan.sync, pipelines, comm_s=grads_ar).batch_s
  critical = int(np.argmax(pipelines))
  use = memory / cluster.memory
  return {"step_s": float(step), "pipeline_s": [float(x) for x in pipelines],
          "critical": critical, **parts[critical], "data_allreduce_s": float(grads_ar),
          "pipe_allreduce_s": float(pipe_ar),
          "memory_bytes": memory.tolist(), "memory_use": float(use.max()),
          "memory_ok": bool(np.all(use <= 1.0))}


def with_prediction(plan: plan_lib.Plan, costs: costs_lib.ModelCosts,
                    cluster: cluster_lib.Cluster) -> plan_lib.Plan:
  """`plan` with its `predicted_s` and `breakdown` from `predict` on `cluster`."""
  out = predict(plan, costs, cluster)
  return dataclasses.replace(plan, predicted_s=out["step_s"], breakdown=out)
