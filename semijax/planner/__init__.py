"""The partition and placement planner of HarmonyTrain's PatchPipe (docs/pipeline.md).

From the model's costs, device speeds and memory and a link matrix, it chooses the devices to
use (leaving the others idle where that is faster), the mesh (data x pipe x tensor), the device
at every position, the layers per stage, the units per tensor position, the microbatches per
pipeline, the microbatch size, schedule and sync mode, with the predicted step time.

  cluster    devices, memory, links; builders from regions; interchangeable device classes
  costs      the model's FLOPs and parameters per unit, layer and edge
  plan       `Plan` and its readable form
  predict    the time model of a plan, loop by loop (what the emulation reproduces)
  evaluate   the same time model vectorized for the search
  split      exact sub-solvers: unit splits, layer partitions, microbatch splits
  request    a validated planning request; search candidates
  exact      the exhaustive search with symmetries and a bound (small clusters)
  hierarchy  the search over regions and device classes (large clusters)
  search     `plan(...)`: the planner
  baselines  Megatron-style, an even pipeline, a compute-only planner, the full planner

Between `models | balance | sync` and `train | runtime | sim` in the import layers.
"""
