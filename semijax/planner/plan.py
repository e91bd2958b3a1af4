"""`Plan`: a data x pipe x tensor placement of a model on a cluster, and its readable forms.

A plan places devices on the mesh (data, pipe, tensor), row-major: `device_order[(d * pipe + p)
* tensor + t]` is the device of pipeline d, stage p, tensor position t. The cluster's other
devices, if any, are `idle`: they hold and run nothing (a plan leaves a device idle where the
others are faster without it). Every data-parallel
pipeline is a replica of one structure: the same layers per stage (`stage_layers`) and the same
units per tensor position (`stage_units`), and takes its own number of microbatches
(`microbatches`: faster pipelines take more). Its `predicted_s` and `breakdown` come from
`predict.predict`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import numpy as np

from semijax.core import schedule as schedule_lib
from semijax import errors
from semijax.sync import settings as sync_settings


def _positive_int(name: str, v) -> None:
  if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
    raise errors.ConfigError(f"plan.{name}: must be an integer >= 1, got {v!r}")


@dataclasses.dataclass(frozen=True)
class Plan:
  """A partition and placement (see module doc).

  Attributes:
    data, pipe, tensor: the mesh; data * pipe * tensor devices take part.
    device_order: the device id at each mesh position, row-major over (data, pipe, tensor).
    stage_layers: layers per stage (len pipe, summing to the model's layers), shared by every
      pipeline.
    stage_units: per stage {kind: units per tensor position} (len pipe; every count >= 1),
      shared by every pipeline.
    microbatches: microbatches per pipeline (len data); each step trains
      sum(microbatches) * microbatch_size examples.
    microbatch_size: examples per microbatch.
    schedule: the pipeline schedule (`core.schedule.SCHEDULES`).
    sync: how the pipelines combine gradients (`sync.settings.MODES`).
    idle: the cluster's devices outside the mesh (ascending); with `device_order` they are the
      ids 0 .. num_devices - 1, each once.
    predicted_s: the predicted seconds per global batch (nan before `predict`).
    breakdown: its parts (`predict.predict`'s dict), or None.
  """

  data: int
  pipe: int
  tensor: int
  device_order: tuple[int, ...]
  stage_layers: tuple[int, ...]
  stage_units: tuple[dict, ...]
  microbatches: tuple[int, ...]
  microbatch_size: int
  schedule: str = "gpipe"
  sync: str = "sync"
  idle: tuple[int, ...] = ()
  predicted_s: float = math.nan
  breakdown: dict | None = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    for name in ("data", "pipe", "tensor", "microbatch_size"):
      _positive_int(name, getattr(self, name))
    order, idle = self._devices()
    layers = tuple(int(x) for x in self.stage_layers)
    if len(layers) != self.pipe or min(layers) < 1:
      raise errors.ConfigError(f"plan.stage_layers: need {self.pipe} counts >= 1, got {layers}")
    units = tuple({k: tuple(int(c) for c in v) for k, v in dict(u).items()}
                  for u in self.stage_units)
    if len(units) != self.pipe or any(len(c) != self.tensor or min(c) < 0 or sum(c) < 1
                                      for u in units for c in u.values()):
      raise errors.ConfigError(f"plan.stage_units: need per stage ({self.pipe}) "
                               f"{{kind: {self.tensor} counts >= 0, not all 0}}, got {units}")
    micro = tuple(int(x) for x in self.microbatches)
    if len(micro) != self.data or min(micro) < 1:
      raise errors.ConfigError(f"plan.microbatches: need {self.data} counts >= 1, got {micro}")
    if self.schedule not in schedule_lib.SCHEDULES:
      raise errors.ConfigError(f"plan.schedule: {self.schedule!r} is not one of "
                               f"{schedule_lib.SCHEDULES}")
    if self.sync not in sync_settings.MODES:
      raise errors.ConfigError(f"plan.sync: {self.sync!r} is not one of {sync_settings.MODES}")
    object.__setattr__(self, "device_order", order)
    object.__setattr__(self, "idle", idle)
    object.__setattr__(self, "stage_layers", layers)
    object.__setattr__(self, "stage_units", units)
    object.__setattr__(self, "microbatches", micro)

  def _devices(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(device_order, idle) as ints, checked: together the ids 0 .. D - 1, each once."""
    n = self.data * self.pipe * self.tensor
    if not isinstance(self.idle, (tuple, list, np.ndarray)) or any(
        isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in self.idle):
      raise errors.ConfigError(f"plan.idle: need a list of device ids, got {self.idle!r}")
    order = tuple(int(x) for x in self.device_order)
    idle = tuple(sorted(int(x) for x in self.idle))
    if sorted(order + idle) != list(range(n + len(idle))):
      rest = f" and the {len(idle)} idle ones {idle}" if idle else ""
      raise errors.ConfigError(f"plan.device_order: need the {n} mesh devices (data x pipe x "
                               f"tensor){rest} to be the ids 0 .. {n + len(idle) - 1} once each, "
                               f"got {order}")
    return order, idle

  @property
  def num_devices(self) -> int:
    """The devices of the cluster it is for: the mesh's and the idle ones."""
    return self.data * self.pipe * self.tensor + len(self.idle)

  @property
  def mesh_devices(self) -> int:
    """The devices that take part: data * pipe * tensor."""
    return self.data * self.pipe * self.tensor

  @property
  def global_batch(self) -> int:
    return sum(self.microbatches) * self.microbatch_size

  def grid(self) -> np.ndarray:
    """int [data, pipe, tensor]: the device at each mesh position."""
    return np.asarray(self.device_order, np.int64).reshape(self.data, self.pipe, self.tensor)

  def to_dict(self) -> dict[str, Any]:
    out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
    out["stage_units"] = [dict(u) for u in self.stage_units]
    return json.loads(json.dumps(out, default=_jsonable))


def _jsonable(x):
  if isinstance(x, np.ndarray):
    return x.tolist()
  if isinstance(x, (np.integer, np.floating)):
    return x.item()
  raise TypeError(f"not JSON serializable: {type(x)}")


def _name(device: int, regions) -> str:
  """A device as the printed plan shows it: its id, with regions its id@region."""
  return f"{device}@{regions[device]}" if regions is not None else str(device)


def idle_line(plan: Plan, regions=None, speeds=None, shown: int = 8) -> str:
  """'idle devices: ...' for a plan that leaves devices idle (else ''): the devices grouped by
  speed when `speeds` (float [D]) is given, at most `shown` listed per group."""
  if not plan.idle:
    return ""
  groups: dict = {}
  for i in plan.idle:
    groups.setdefault(None if speeds is None else float(speeds[i]), []).append(i)
  parts = []
  for speed, ids in groups.items():
    names = " ".join(_name(i, regions) for i in ids[:shown])
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    parts.append(names + more + ("" if speed is None else f" (speed {speed:.4g})"))
  return "idle devices: " + ", ".join(parts)


def describe(plan: Plan, regions=None, max_pipelines: int = 4, speeds=None) -> str:
  """A readable multi-line summary: mesh, schedule, idle devices (if any), each stage's layers,
  devices and unit splits, microbatches per pipeline, and the predicted time with its parts.

  Args:
    plan: the plan; regions: optional int [D] region per device (shown as device@region).
    max_pipelines: the pipelines whose devices are listed per stage (the rest are counted).
    speeds: optional float [D] speed per device (shown for the idle ones).
  """
  grid = plan.grid()
  lines = [f"mesh data={plan.data} pipe={plan.pipe} tensor={plan.tensor}  schedule={plan.schedule}"
           f"  sync={plan.sync}  microbatch_size={plan.microbatch_size}  "
           f"global batch={plan.global_batch}"]
  idle = idle_line(plan, regions, speeds)
  if idle:
    lines.append(idle)
  for p in range(plan.pipe):
    units = "  ".join(f"{k}={list(v)}" for k, v in plan.stage_units[p].items())
    lines.append(f"stage {p}: {plan.stage_layers[p]} layers  {units}")
    for d in range(min(plan.data, max_pipelines)):
      devs = [_name(i, regions) for i in grid[d, p]]
      lines.append(f"  pipeline {d}: devices {' '.join(devs)}")
    if plan.data > max_pipelines:
      lines.append(f"  ... and {plan.data - max_pipelines} more pipelines")
  counts = sorted(set(plan.microbatches))
  shown = (list(plan.microbatches) if plan.data <= 16 else
           "  ".join(f"{m} x{plan.microbatches.count(m)}" for m in counts))
  lines.append(f"microbatches per pipeline: {shown}")
  if not math.isnan(plan.predicted_s):
    lines.append(f"predicted step: {plan.predicted_s:.6g} s")
  if plan.breakdown:
    b = plan.breakdown
    lines.append(f"  slowest pipeline {b['critical']}: {b['pipeline_s'][b['critical']]:.6g} s = "
                 f"compute {b['compute_s']:.6g} s (tensor all-reduces {b['tensor_allreduce_s']:.4g}"
                 f" s, bubble {100 * b['bubble']:.1f}%) + transfers {b['transfer_s']:.4g} s")
    lines.append(f"  gradient all-reduces: {b['data_allreduce_s']:.4g} s (of it over the stages "
                 f"{b.get('pipe_allreduce_s', 0.0):.4g} s)   peak memory use "
                 f"{100 * b['memory_use']:.1f}% of the tightest device")
  return "\n".join(lines)
