"""Bucket geometry: the capacity buckets a run's layouts live in, and layouts with target counts.

A run of a fixed layout (`even`, `static`) stays in the bucket of its configured layout. The
dynamic policies start in the *tight* bucket of the even split (capacity = the even share, no
padded slack to update) and move uneven splits into the *big* bucket (`capacity_factor` x the
even share, `num_widths` compute widths); a split that fits the tight bucket again goes back to
it. `offload` keeps ownership and runs in the big bucket throughout.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from semijax.core import layout as layout_lib
from semijax.core import migrate as migrate_lib

Layout = layout_lib.Layout


def bucket_layout(layout: Layout, factor: float, num_widths: int, zero: bool = False) -> Layout:
  """`layout` (same owners) in a bucket of capacity ceil(factor * U / N) per kind (at most
  U - N + 1, at least the largest count), with `num_widths` compute widths. If `zero` (a device
  may be drained), also the width 0 and the even share of the other N - 1 devices,
  ceil(U / (N - 1)), so that draining one device wastes no bucket width."""
  kinds = {}
  for kind, u in layout.kinds().items():
    n = u.num_devices
    cap = min(u.num_units - n + 1, math.ceil(factor * u.num_units / n))
    cap = max(cap, max(u.counts))
    widths = set(layout_lib.default_widths(cap, num_widths, zero))
    if zero and n > 1 and math.ceil(u.num_units / (n - 1)) <= cap:
      widths.add(math.ceil(u.num_units / (n - 1)))
    kinds[kind] = layout_lib.UnitLayout(kind, u.num_units, u.owned, cap, u.counts,
                                        tuple(sorted(widths)))
  return Layout(**kinds)


def tight_layout(big: Layout) -> Layout:
  """`big` (same owners) at the capacity of its largest count, with the widths of `big` below
  it: the bucket an even split lives in between migrations (no padded slack to update)."""
  kinds = {}
  for kind, u in big.kinds().items():
    cap = max(u.counts)
    kinds[kind] = u.replace(capacity=cap, widths=tuple(w for w in u.widths if w < cap) + (cap,))
  return Layout(**kinds)


def bucket_like(layout: Layout, bucket: Layout) -> Layout:
  """`layout`'s owners at the capacity and widths of `bucket`."""
  return Layout(**{k: u.replace(capacity=bucket.kinds()[k].capacity,
                                widths=bucket.kinds()[k].widths)
                   for k, u in layout.kinds().items()})


def own_widths(layout: Layout) -> Layout:
  """`layout` compiled at exactly its counts' widths (a fixed split executes only those)."""
  return Layout(**{k: u.replace(widths=tuple(sorted(set(u.counts))))
                   for k, u in layout.kinds().items()})


def rebalance(layout: Layout, target: dict) -> Layout:
  """A layout with `target` {kind: counts}, moving as few units as possible: devices above their
  target hand their last units to devices below theirs (same capacity and widths)."""
  moves = {}
  for kind, u in layout.kinds().items():
    want = target[kind]
    surplus = [unit for d, o in enumerate(u.owned) for unit in o[want[d]:][::-1]]
    need = [d for d in range(u.num_devices) for _ in range(max(want[d] - u.counts[d], 0))]
    moves[kind] = list(zip(surplus[::-1], need))
  return migrate_lib.move_units(layout, moves)


def shift_one(counts, capacity) -> tuple:
  """Counts with one unit moved from the largest to the smallest device (a warm-up target): the
  first largest, the last smallest, so that an even split changes too."""
  counts = list(counts)
  hi, lo = int(np.argmax(counts)), len(counts) - 1 - int(np.argmin(counts[::-1]))
  if hi != lo and counts[hi] > 1 and counts[lo] < capacity:
    counts[hi] -= 1
    counts[lo] += 1
  return tuple(counts)


def capacities(layout: Layout) -> dict:
  return {k: u.capacity for k, u in layout.kinds().items()}


@dataclasses.dataclass(frozen=True)
class Buckets:
  """The buckets of a run: `start` (where it begins) and `big` (where uneven splits of the
  dynamic policies live; `start` itself when there is no other).

  Attributes:
    start: the layout a run starts in.
    big: the start's owners in the big bucket.
  """

  start: Layout
  big: Layout

  @classmethod
  def fixed(cls, layout: Layout) -> "Buckets":
    """One bucket: the layout itself."""
    return cls(layout, layout)

  @classmethod
  def dynamic(cls, layout: Layout, factor: float, num_widths: int, tight: bool,
              zero: bool = False) -> "Buckets":
    """The big bucket of `layout` and, if `tight`, the tight one of its even split to start in;
    both compile the width 0 if `zero`."""
    big = bucket_layout(layout, factor, num_widths, zero)
    start = tight_layout(big) if tight else big
    if capacities(start) == capacities(big):
      big = start
    return cls(start, big)

  @property
  def single(self) -> bool:
    """Whether the run has one bucket (uneven splits live in the start bucket)."""
    return capacities(self.start) == capacities(self.big)

  def layouts(self) -> list[Layout]:
    """One layout per bucket: the start and, if it is another bucket, the big one."""
    return [self.start] if self.single else [self.start, self.big]

  def is_start(self, layout: Layout) -> bool:
    return capacities(layout) == capacities(self.start)

  def target(self, layout: Layout, counts: dict) -> Layout:
    """The layout with `counts`, moving as few units as possible from `layout`: in the start
    bucket when they fit it (the even split), else in the big one."""
    big = rebalance(bucket_like(layout, self.big), counts)
    tight = tight_layout(big)
    return tight if capacities(tight) == capacities(self.start) else big

  def warm_target(self, layout: Layout) -> Layout:
    """An uneven split in the big bucket one unit away from `layout` (what warm-up moves to)."""
    return rebalance(bucket_like(layout, self.big),
                     {k: shift_one(u.counts, u.capacity) for k, u in self.big.kinds().items()})
