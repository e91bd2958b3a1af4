"""The time of one training step on a simulated cluster, from executed widths and device speeds.

For replica r, pipeline stage s and its tensor group (devices t), with executed widths
w[k][s, t, l] of unit kind k in the stage's block l (`core.plan.executed_widths`) and speeds
v[r, s, t], one microbatch of a stage takes

  tau[r, s] = sum_{l, k} ( f_s * max_t c_k * w[k][s, t, l] / v[r, s, t]      (block compute)
                           + 2 * allreduce(tensor link) )                    (forward, backward)
            + repeated_s[s] / min_{t busy} v[r, s, t]                        (norms, head, loss)
            + boundary (activations to the next stage, over a pipe link)

where a device is *busy* in stage s if it executes some unit there (w[k][s, t, l] > 0 for some
k, l): a drained device (no units of any kind, `core.layout.Layout.drained`) neither computes
blocks nor repeats the work every tensor device repeats (embedding, norms, head, loss, the
optimizer update of the replicated parameters), so its speed leaves the step, as it leaves the
library's cost model (`balance.cost.busy`). c_k is a unit's forward + backward seconds at
speed 1 (`Workload.unit_flops` x tokens / `Hardware.device_flops`) and f_s is the step variant's
factor: 1 for the single-width step, 1 + `branch_overhead` for the branched one,
1 + `resize_overhead` for the resized one, 1 + `offload_overhead` for the offload one. On a host
whose fake devices share `cores` cores a block takes at least its summed work over `cores`, and
each busy device's copy of the repeated work and the update takes its turn. Devices
that share physical cores (`Hardware.idle_speedup` a > 1: processes on the hyperthreads of one
core) run the blocks' full-speed devices faster while others of them wait: with n devices of
the tensor group at full speed and k of them still computing, each computes at min(a, n / k)
times its speed (`shared_finish`; a device slowed by a competitor keeps its speed, and its core
goes to the competitor when it waits), so an uneven split of uncontended devices costs less
than its slowest device's share says. A replica's step runs the microbatches through the
stages (one forward-backward pipeline, GPipe / 1F1B: sum_s tau + (M - 1) max_s tau), then
every device updates its state (the optimizer reads and writes the parameters and both moments
at their stored dtypes, `Workload.nbytes`, at `memory_bytes_per_s`; the busy devices, at the
slowest busy speed), plus `step_overhead_s`, plus `contention_wait_s` x (1 - the replica's
slowest busy speed) (a process sharing its core with a competitor wakes up late from the step's
collectives). The replicas are combined by a data-parallel strategy (`semijax.sim.strategies`):
for synchronous data parallelism, the slowest replica plus a ring all-reduce of the gradients
(in the parameters' dtype).

Everything is numpy over [R, S, T, L] at once: one step of 4,096 devices costs well under a
millisecond of host time. A model keeps the replica times of inputs it has seen
(`MEMO_ENTRIES`): a run's steps repeat a few splits and speeds, so a replay computes each once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from semijax.core import plan as plan_lib
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import workload as workload_lib

# The fitted coefficient of each compiled step variant (`balance.policies.STEP_KINDS`) beyond
# the single-width step, as `Hardware` names it.
OVERHEADS = {"branched": "branch_overhead", "resized": "resize_overhead",
             "offload": "offload_overhead"}
# Speeds at or above this are a device at full speed (no competitor on its core).
FULL_SPEED = 1.0 - 1e-9
# Most distinct inputs of `StepModel.step` whose replica times a model keeps: a run's steps
# repeat a few splits and speeds, and recomputing them was most of a replay's host time.
MEMO_ENTRIES = 4096


def _key(x) -> tuple:
  """A hashable, exact key of an array or scalar: its dtype, shape and bytes."""
  a = np.asarray(x)
  return a.dtype.str, a.shape, a.tobytes()


def shared_finish(per: np.ndarray, free: np.ndarray, speedup: float) -> np.ndarray:
  """float [..., L]: when each block's last device finishes, `per` float [..., T, L] the seconds
  of each device at its own speed and `free` bool [..., T, 1] the devices at full speed: those
  share their cores' capacity, each computing at min(`speedup`, n / k) times its speed while k
  of the n still compute (water-filling: the k smallest works end first); the others take
  `per`. With `speedup` 1 it is the slowest device's seconds."""
  t = per.shape[-2]
  n = free.sum(axis=-2, keepdims=True)                                  # [..., 1, 1]
  work = np.sort(np.where(free, per, 0.0), axis=-2)                     # [..., T, L]
  step = np.diff(work, axis=-2, prepend=0.0)                            # work between two ends
  computing = (t - np.arange(t))[:, None]                               # [T, 1]
  rate = np.minimum(speedup, n / computing)
  shared = np.where(np.arange(t)[:, None] >= t - n, step / np.maximum(rate, 1e-30), 0.0)
  return np.maximum(shared.sum(axis=-2), np.where(free, 0.0, per).max(axis=-2))


def busy_devices(widths: dict) -> np.ndarray:
  """bool [S, T]: the devices that execute some unit in their stage, `widths` {kind: float
  [S, T, L]} (the others are drained: no blocks, no repeated work). A stage in which nobody
  would be busy counts every device busy."""
  busy = plan_lib.executes(widths)
  return busy | ~busy.any(axis=1, keepdims=True)


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One simulated step.

  Attributes:
    seconds: the step (compute, collectives, pipeline, update, data-parallel sync).
    replicas: float [R], each replica's time before the data-parallel sync.
    sync_s: the data-parallel part after the slowest replica.
    features: float [7] what a linear fit of the constants needs: the coefficients of
      (step_overhead_s, 1 / device_flops, the three variants' overheads / device_flops,
      (1 - 1 / idle_speedup) / device_flops, and contention_wait_s).
  """

  seconds: float
  replicas: np.ndarray
  sync_s: float
  features: np.ndarray | None = None


class StepModel:
  """Step times of one workload on one cluster and hardware (see module doc).

  Args:
    workload: the model and batch; cluster: the device grid; hardware: device and link costs.
    layers: layers per pipeline stage (default: as even as possible, the first stages one more).
    strategy: the data-parallel strategy (`strategies.Strategy`).
    idle_feature: compute the features' idle column also where `Hardware.idle_speedup` is 1
      (a fit of it; it costs a second block computation per step).
  """

  def __init__(self, workload: workload_lib.Workload, cluster: cluster_lib.Cluster,
               hardware: hardware_lib.Hardware, strategy, layers: tuple | None = None,
               idle_feature: bool = False):
    self.workload, self.cluster, self.hw, self.strategy = workload, cluster, hardware, strategy
    self.idle_feature = idle_feature
    self._memo: dict = {}      # `step`'s replica times by its inputs (`_replica_times`)
    s, n_layers = cluster.pipe, workload.spec.num_layers
    if layers is None:
      base, rem = divmod(n_layers, s)
      layers = tuple(base + (i < rem) for i in range(s))
    if len(layers) != s or sum(layers) != n_layers or min(layers) < 1:
      raise ValueError(f"sim.layers: {layers} must give each of {s} stages >= 1 of "
                       f"{n_layers} layers")
    self.layers = tuple(int(x) for x in layers)
    tokens = workload.tokens_per_microbatch
    flops = hardware.device_flops
    self.unit_s = {k: f * tokens / flops for k, f in workload.unit_flops().items()}
    tensor = hardware.link("tensor")
    self.allreduce_s = 2 * cluster_lib.allreduce_s(tensor, workload.allreduce_bytes(),
                                                   cluster.tensor)
    edge = workload.last_flops() * tokens / flops
    self.repeated_s = np.array([n * workload.layer_repeated_flops() * tokens / flops
                                + (edge if i == s - 1 else 0.0)
                                for i, n in enumerate(self.layers)])
    self.boundary_s = np.array([0.0 if i == s - 1 else
                                2 * hardware.link("pipe").seconds(workload.boundary_bytes())
                                for i in range(s)])
    self.update_s = np.array([2 * workload.nbytes.state * p / hardware.memory_bytes_per_s
                              for p in self.params_per_device()])

  def params_per_device(self) -> np.ndarray:
    """float [S]: the parameters one device of each stage holds (its share of the units at an
    even split, the repeated ones whole)."""
    w = self.workload
    unit = w.unit_params()
    units = sum(unit[k] * u for k, u in w.spec.num_units().items()) / self.cluster.tensor
    edges = w.edge_params()
    out = []
    for i, n in enumerate(self.layers):
      p = n * (units + w.layer_repeated_params())
      p += edges["first"] if i == 0 else 0
      p += edges["last"] if i == self.cluster.pipe - 1 else 0
      out.append(p)
    return np.asarray(out, np.float64)

  def core_share(self, busy: np.ndarray) -> np.ndarray:
    """float [S]: how many turns each stage's repeated work and update take, `busy` bool [S, T]
    the devices that execute some unit: on fake devices sharing `cores` cores each busy device's
    copy takes its turn (busy devices / cores, at least 1); else 1."""
    if not self.hw.cores:
      return np.ones(busy.shape[0])
    return np.maximum(1.0, busy.sum(axis=1) / self.hw.cores)

  def gradient_bytes(self) -> float:
    """Bytes of the gradients one device all-reduces over the replicas (the largest stage), in
    the parameters' dtype."""
    return float(self.workload.nbytes.grad * self.params_per_device().max())

  def factors(self, kinds) -> np.ndarray:
    """float [S]: the block compute factor of each stage's step variant."""
    return np.array([1 + getattr(self.hw, OVERHEADS[k]) if k in OVERHEADS else 1.0
                     for k in kinds])

  def block_seconds(self, widths: dict, speeds: np.ndarray,
                    speedup: float | None = None) -> np.ndarray:
    """float [R, S]: block compute per microbatch at factor 1 (the sum over blocks of the
    slowest device's time, with devices sharing cores at `speedup` (default
    `Hardware.idle_speedup`) the time of `shared_finish`, or the summed work over `cores`
    when that is more).

    Args:
      widths: {kind: float [S, T, L]} executed widths (stages with fewer layers padded with 0).
      speeds: float [R, S, T].
    """
    speedup = self.hw.idle_speedup if speedup is None else speedup
    out = 0.0
    inv = 1.0 / speeds[..., None]                                        # [R, S, T, 1]
    free = speeds[..., None] >= FULL_SPEED                               # [R, S, T, 1]
    for k, w in widths.items():
      per = self.unit_s[k] * w[None] * inv                               # [R, S, T, L]
      block = per.max(axis=2) if speedup <= 1 else shared_finish(per, free, speedup)
      if self.hw.cores:
        block = np.maximum(block, per.sum(axis=2) / self.hw.cores)
      out = out + block.sum(axis=-1)
    return out

  def step(self, widths: dict, kinds, speeds: np.ndarray, link_factors: np.ndarray,
           extra_s=0.0) -> StepTime:
    """The time of one step.

    Args:
      widths: {kind: float [S, T, L]} executed widths of every stage.
      kinds: the step variant of every stage ("single", "branched", "resized", "offload").
      speeds: float [R, S, T] device speeds; link_factors: float [regions] bandwidth factors.
      extra_s: float [S] or scalar, per-step seconds of a stage outside its blocks (offload
        traffic), paid once per step.
    """
    key = (tuple(kinds), _key(speeds), _key(link_factors), _key(extra_s),
           *((k, _key(w)) for k, w in sorted(widths.items())))
    terms = self._memo.get(key)
    if terms is None:
      terms = self._replica_times(widths, kinds, speeds, link_factors, extra_s)
      if len(self._memo) < MEMO_ENTRIES:
        self._memo[key] = terms
    replicas, sync, features = terms
    seconds, sync_s = self.strategy.combine(replicas, sync)   # (a strategy may keep state)
    return StepTime(float(seconds), replicas, float(sync_s), features)

  def _replica_times(self, widths: dict, kinds, speeds: np.ndarray, link_factors: np.ndarray,
                     extra_s) -> tuple[np.ndarray, float, np.ndarray]:
    """(replicas float [R], the data-parallel all-reduce's seconds, features float [7]) of
    `step`, whose arguments it takes; both arrays read-only (`step` shares them between the
    steps of equal inputs)."""
    f = self.factors(kinds)                                              # [S]
    blocks = self.block_seconds(widths, speeds)                          # [R, S]
    full, idle = self.idle_parts(widths, speeds, blocks)                 # [R, S] each
    busy = busy_devices(widths)                                          # [S, T]
    slowest = np.where(busy, speeds, np.inf).min(axis=2)                 # [R, S]
    share = self.core_share(busy)                                        # [S]
    repeated = self.repeated_s * share / slowest                         # [R, S]
    tau = (f * blocks + self.allreduce_s * np.asarray(self.layers) + repeated
           + self.boundary_s)                                            # [R, S]
    m = self.workload.microbatches
    pipeline = tau.sum(axis=1) + (m - 1) * tau.max(axis=1)               # [R]
    update = (self.update_s * share / slowest + extra_s).max(axis=1)     # [R]
    wait = 1.0 - slowest.min(axis=1)                                     # [R]
    replicas = pipeline + update + self.hw.step_overhead_s + self.hw.contention_wait_s * wait
    sync = cluster_lib.data_ring_s(self.cluster, self.hw, self.gradient_bytes(), link_factors)
    # What a fit of the constants needs: the slowest replica's terms by coefficient (exact for
    # one stage; with a pipeline the microbatch count stands in for its schedule).
    r = int(np.argmax(replicas))
    scale = self.hw.device_flops * m
    by_kind = [sum(full[r, i] for i, k in enumerate(kinds) if k == kind) for kind in OVERHEADS]
    compute = full[r].sum() + repeated[r].sum()
    features = scale * np.array([1.0 / scale, compute, *by_kind, -(f * idle[r]).sum(),
                                 wait[r] / scale])
    replicas.setflags(write=False)
    features.setflags(write=False)
    return replicas, float(sync), features

  def idle_parts(self, widths: dict, speeds: np.ndarray, blocks: np.ndarray):
    """(full, idle), float [R, S] each: `blocks` (at `Hardware.idle_speedup` a) is
    full - (1 - 1 / a) * idle, with `full` the blocks at a = 1 (the slowest device's seconds)
    and `idle` what the shared cores save at a = 2 over 1/2 (exact for tensor groups of 2, where
    the saving is linear in 1 / a; at a = 1 the fit's column for a)."""
    a = self.hw.idle_speedup
    if a <= 1 and not self.idle_feature:
      return blocks, np.zeros_like(blocks)
    full = blocks if a <= 1 else self.block_seconds(widths, speeds, 1.0)
    probe = a if a > 1 else hardware_lib.MAX_IDLE_SPEEDUP
    shared = blocks if a > 1 else self.block_seconds(widths, speeds, probe)
    return full, (full - shared) / (1 - 1 / probe)
