"""The time of one training step on a simulated cluster, from executed widths and device speeds.

For replica r, pipeline stage s and its tensor group (devices t), with executed widths
w[k][s, t, l] of unit kind k in the stage's block l (`core.plan.executed_widths`) and speeds
v[r, s, t], one microbatch of a stage takes

  tau[r, s] = sum_{l, k} ( f_s * max_t c_k * w[k][s, t, l] / v[r, s, t]      (block compute)
                           + 2 * allreduce(tensor link) )                    (forward, backward)
            + repeated_s[s] / min_t v[r, s, t]                               (norms, head, loss)
            + boundary (activations to the next stage, over a pipe link)

where c_k is a unit's forward + backward seconds at speed 1 (`Workload.unit_flops` x tokens /
`Hardware.device_flops`) and f_s is the step variant's factor: 1 for the single-width step,
1 + `branch_overhead` for the branched one, 1 + `resize_overhead` for the resized one,
1 + `offload_overhead` for the offload one. On a host whose
fake devices share `cores` cores a block takes at least its summed work over `cores`. A
replica's step runs the microbatches through the stages (one forward-backward pipeline,
GPipe / 1F1B: sum_s tau + (M - 1) max_s tau), then every device updates its state (the
optimizer reads and writes the parameters and both moments: `memory_bytes_per_s`), plus
`step_overhead_s`. The replicas are combined by a data-parallel strategy
(`semijax.sim.strategies`): for synchronous data parallelism, the slowest replica plus a ring
all-reduce of the gradients.

Everything is numpy over [R, S, T, L] at once: one step of 4,096 devices costs well under a
millisecond of host time.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import workload as workload_lib

# The fitted coefficient of each compiled step variant (`balance.policies.STEP_KINDS`) beyond
# the single-width step, as `Hardware` names it.
OVERHEADS = {"branched": "branch_overhead", "resized": "resize_overhead",
             "offload": "offload_overhead"}


@dataclasses.dataclass(frozen=True)
class StepTime:
  """One simulated step.

  Attributes:
    seconds: the step (compute, collectives, pipeline, update, data-parallel sync).
    replicas: float [R], each replica's time before the data-parallel sync.
    sync_s: the data-parallel part after the slowest replica.
    features: float [5] what a linear fit of the constants needs: the coefficients of
      (step_overhead_s, 1 / device_flops, and the three variants' overheads / device_flops).
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
  """

  def __init__(self, workload: workload_lib.Workload, cluster: cluster_lib.Cluster,
               hardware: hardware_lib.Hardware, strategy, layers: tuple | None = None):
    self.workload, self.cluster, self.hw, self.strategy = workload, cluster, hardware, strategy
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
    self.update_s = np.array([2 * 3 * workload_lib.F32 * p / hardware.memory_bytes_per_s
                              for p in self.params_per_device()])
    if hardware.cores:        # fake devices on shared cores: each one's copy takes its turn
      share = max(1.0, cluster.tensor / hardware.cores)
      self.repeated_s = self.repeated_s * share
      self.update_s = self.update_s * share

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

  def gradient_bytes(self) -> float:
    """Bytes of the gradients one device all-reduces over the replicas (the largest stage)."""
    return float(workload_lib.F32 * self.params_per_device().max())

  def factors(self, kinds) -> np.ndarray:
    """float [S]: the block compute factor of each stage's step variant."""
    return np.array([1 + getattr(self.hw, OVERHEADS[k]) if k in OVERHEADS else 1.0
                     for k in kinds])

  def block_seconds(self, widths: dict, speeds: np.ndarray) -> np.ndarray:
    """float [R, S]: block compute per microbatch at factor 1 (the sum over blocks of the
    slowest device's time, or the summed work over `cores` when that is more).

    Args:
      widths: {kind: float [S, T, L]} executed widths (stages with fewer layers padded with 0).
      speeds: float [R, S, T].
    """
    out = 0.0
    inv = 1.0 / speeds[..., None]                                        # [R, S, T, 1]
    for k, w in widths.items():
      per = self.unit_s[k] * w[None] * inv                               # [R, S, T, L]
      block = per.max(axis=2)
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
    f = self.factors(kinds)                                              # [S]
    blocks = self.block_seconds(widths, speeds)                          # [R, S]
    slowest = speeds.min(axis=2)                                         # [R, S]
    tau = (f * blocks + self.allreduce_s * np.asarray(self.layers) + self.repeated_s / slowest
           + self.boundary_s)                                            # [R, S]
    m = self.workload.microbatches
    pipeline = tau.sum(axis=1) + (m - 1) * tau.max(axis=1)               # [R]
    update = (self.update_s / slowest + extra_s).max(axis=1)             # [R]
    replicas = pipeline + update + self.hw.step_overhead_s
    sync = cluster_lib.data_ring_s(self.cluster, self.hw, self.gradient_bytes(), link_factors)
    seconds, sync_s = self.strategy.combine(replicas, sync)
    # What a fit of the constants needs: the slowest replica's terms by coefficient (exact for
    # one stage; with a pipeline the microbatch count stands in for its schedule).
    r = int(np.argmax(replicas))
    scale = self.hw.device_flops * m
    by_kind = [sum(blocks[r, i] for i, k in enumerate(kinds) if k == kind) for kind in OVERHEADS]
    compute = blocks[r].sum() + (self.repeated_s / slowest[r]).sum()
    features = scale * np.array([1.0 / scale, compute, *by_kind])
    return StepTime(float(seconds), replicas, float(sync_s), features)
