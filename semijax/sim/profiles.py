"""Hardware that cannot be measured here: nominal profiles, each number with its source.

`gpu_h100` is a cluster of H100-class GPUs, 8 per node (one tensor group per node over NVLink),
nodes joined by 400 Gb/s InfiniBand, and, for the `slow_link` scenario, two regions joined by a
wide-area link. Datasheet peaks are scaled by the efficiency large training jobs report; the
dimensionless constants are the library's own counts where the CPU fits do not carry over.

  device_flops        989 TFLOP/s dense BF16 (H100 SXM datasheet) x 0.4, the model FLOPs
                      utilization of large Megatron-style jobs (about 40-55% reported)
  memory_bytes_per_s  3.35 TB/s HBM3 x 0.8
  links.tensor        NVLink 4: 450 GB/s per direction; NCCL's all-reduce reaches about 360
                      GB/s bus bandwidth in a node; 10 us latency
  links.pipe / data   NDR InfiniBand, 400 Gb/s = 50 GB/s per GPU, about 40 GB/s achieved; 20 us
  links.region        an inter-region link of 400 Gb/s per node, 6.25 GB/s per GPU; 5 ms latency
                      (an assumption: HarmonyTrain's regions, no public figure)
  branch_overhead     the library cost model's branched-step factor, `balance.cost.
                      BRANCH_OVERHEAD` (0.05, measured here since the branches keep their padded
                      GEMM outputs instead of recomputing the forward pass); the resized and
                      offload steps are branched steps too (the CPU fits' larger values for them
                      come from XLA:CPU's gathers and are not carried over)
  step_overhead_s     2 ms of launch and host work per step (an assumption)
  move_*              20 ms to launch a migration (an assumption); its local gathers at a quarter
                      of memory bandwidth; its all_to_all at half the NVLink all-reduce bandwidth
  sample_s            1 ms: the shared speed sample's all-gather over every process (about
                      log2(P) rounds of 20 us at P = 512 processes, rounded up)
  sample_noise        this machine's measured noise of one speed sample (`cpu_2proc`)
  step_noise          1% step-to-step jitter (an assumption: accelerator steps are steadier than a
                      shared CPU's 5%)
"""

from __future__ import annotations

from semijax.balance import cost as cost_lib
from semijax.sim import hardware as hardware_lib

GPU = "gpu_h100"


def gpu_h100(sample_noise: float) -> hardware_lib.Hardware:
  """The nominal H100-class cluster (see module doc); `sample_noise` from a fitted profile."""
  nvlink = 3.6e11
  return hardware_lib.Hardware(
      GPU, device_flops=0.4 * 989e12, branch_overhead=cost_lib.BRANCH_OVERHEAD,
      resize_overhead=cost_lib.BRANCH_OVERHEAD, offload_overhead=cost_lib.BRANCH_OVERHEAD,
      step_overhead_s=2e-3, memory_bytes_per_s=0.8 * 3.35e12,
      links={"tensor": hardware_lib.Link(1e-5, nvlink), "pipe": hardware_lib.Link(2e-5, 4e10),
             "data": hardware_lib.Link(2e-5, 4e10), "region": hardware_lib.Link(5e-3, 6.25e9)},
      move_fixed_s=0.02, move_local_bytes_per_s=0.25 * 0.8 * 3.35e12,
      move_bytes_per_s=0.5 * nvlink, sample_s=1e-3, sample_noise=sample_noise, step_noise=0.01,
      source="nominal: semijax/sim/profiles.py (datasheets x reported efficiency; assumptions "
             "named there)")
