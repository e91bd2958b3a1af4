"""Where a pipelined model's layers and units live (`PipeLayout`) and what every device computes
in one pipelined step (`PipePlan`); `core.pipeline` runs steps with them (see its module doc).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax

from semijax.core import layout as layout_lib
from semijax.errors import LayoutError

LAYERS = layout_lib.LAYERS


# --- where layers and units live ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PipeLayout:
  """Layers of every stage and the tensor layout inside every stage (`core.pipeline`'s doc).

  Attributes:
    layers: a `UnitLayout` of kind "layers": `owned[s]` the layer ids of stage s (a contiguous
      run, ascending, the runs in stage order), `capacity` the slots per stage, `active` the
      counts.
    units: one `Layout` per stage; all with the same capacities and compute widths per kind.
  """

  layers: layout_lib.UnitLayout
  units: tuple

  def __post_init__(self):
    if self.layers.kind != LAYERS:
      raise LayoutError(f"layout.layers: expected kind {LAYERS!r}, got {self.layers.kind!r}")
    if len(self.units) != self.layers.num_devices:
      raise LayoutError(f"layout.units: {len(self.units)} stage layouts for "
                        f"{self.layers.num_devices} stages")
    nxt = 0
    for s, owned in enumerate(self.layers.owned):
      if list(owned) != list(range(nxt, nxt + len(owned))):
        raise LayoutError(f"layout.layers.owned: stage {s} holds layers {list(owned)}, not the "
                          f"next contiguous run from layer {nxt}")
      nxt += len(owned)
    if len({u.bucket() for u in self.units}) != 1:
      raise LayoutError("layout.units: every stage's tensor layout must share its capacities and "
                        f"compute widths, got {[u.bucket() for u in self.units]}")

  @classmethod
  def build(cls, num_layers: int, stage_layers, stage_units: Sequence[layout_lib.Layout],
            capacity: int | None = None) -> "PipeLayout":
    """Stages holding `stage_layers` layers each ("even" or a count per stage), in order."""
    stages = len(stage_units)
    if isinstance(stage_layers, str):
      if stage_layers != "even":
        raise LayoutError(f"pipeline.layers: {stage_layers!r} is not 'even' or counts")
      counts = layout_lib.even_counts(num_layers, stages)
    else:
      counts = tuple(int(c) for c in stage_layers)
    if len(counts) != stages or sum(counts) != num_layers or min(counts) < 1:
      raise LayoutError(f"pipeline.layers: counts {counts} must give each of the {stages} stages "
                        f"at least one layer and sum to the model's {num_layers}")
    cap = max(counts) if capacity is None else int(capacity)
    layers = layout_lib.UnitLayout.from_counts(LAYERS, counts, capacity=cap, widths=(cap,))
    return cls(layers, tuple(stage_units))

  @classmethod
  def canonical(cls, num_layers: int, num_units: dict, stages: int,
                tensor: int) -> "PipeLayout":
    """The layout of the sharded logical form: layers and units in order, evenly split."""
    units = layout_lib.Layout.canonical(num_units, tensor)
    return cls(layout_lib.UnitLayout.canonical(LAYERS, num_layers, stages), (units,) * stages)

  @property
  def stages(self) -> int:
    return self.layers.num_devices

  @property
  def stage_layers(self) -> tuple[int, ...]:
    return self.layers.counts

  def bucket(self) -> tuple:
    """What compiled programs depend on: layer slots per stage and the units' bucket."""
    return (self.layers.capacity, self.units[0].bucket())

  def with_units(self, units: Sequence[layout_lib.Layout]) -> "PipeLayout":
    return PipeLayout(self.layers, tuple(units))

  def to_json(self) -> dict:
    return {"layers": [list(o) for o in self.layers.owned], "layer_capacity": self.layers.capacity,
            "units": [u.to_json() for u in self.units]}

  @classmethod
  def from_json(cls, d: dict) -> "PipeLayout":
    counts = tuple(len(o) for o in d["layers"])
    layers = layout_lib.UnitLayout.from_counts(LAYERS, counts, capacity=d["layer_capacity"],
                                               widths=(d["layer_capacity"],))
    return cls(layers, tuple(layout_lib.Layout.from_json(u) for u in d["units"]))


# --- the plan of a step ---------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("active", "layers", "table"),
                   meta_fields=("widths",))
@dataclasses.dataclass(frozen=True)
class PipePlan:
  """What every device computes in one pipelined step (data: no recompile when it changes).

  Attributes:
    active: {kind: int32 [P, N]} units each device of each stage computes, split over
      (pipe, tensor).
    layers: int32 [P] layers each stage runs, split over `pipe`.
    table: int32 [D, T, P, 2] each data replica's tick table (`core.schedule.table`), padded
      with idle ticks to the longest; split over `data`.
    widths: ((kind, compiled widths), ...), static.
  """

  active: dict
  layers: jax.Array
  table: jax.Array
  widths: tuple
