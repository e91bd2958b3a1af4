"""Uneven unit layouts for 1-D tensor parallelism.

A *unit* is the smallest piece of a tensor-parallel (TP) layer that one device can own:
  * kind "mlp": one hidden unit of an MLP (a column of the up-projection, its bias, and a row of
    the down-projection; a Llama's gate and up projections both);
  * kind "heads": one attention head (head_dim columns of Q, K and V, their biases, and head_dim
    rows of the output projection); with grouped-query attention (a Llama) one KV group: its key
    and value heads and the query heads that share them, so a device never splits a group.

A `UnitLayout` says, for one kind and every device of the `tensor` mesh axis,
  * `owned[d]`: the logical unit ids device d owns, in local slot order;
  * `capacity` C: the number of slots of the padded local block (the same on every device, because
    JAX needs equal local shapes);
  * `active[d]`: how many leading slots device d computes this step (active <= owned <= C);
  * `widths`: the compute widths compiled ahead of time (ascending, the last equals C). Device d
    executes its GEMMs at the smallest width >= active[d], not at C. A leading width 0 is a
    branch that computes nothing: a device that owns no units (a *drained* device, e.g. one
    failing slowly) then executes nothing in the block, rather than the smallest width.

Zero is a valid count: a device may own no units of a kind, as long as some device owns each
unit (the counts sum to the model's units).

Padded, device-major arrays: the unit axis of a logical array with U units becomes N*C slots (times
the unit size). Device d holds slots [d*C, (d+1)*C); slot d*C + s holds logical unit owned[d][s] for
s < len(owned[d]) and zeros after. `pack` and `unpack` convert between the two.

Every check raises `LayoutError` with a message that starts with the field it is about, e.g.
"layout.mlp.capacity: ...", before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from semijax import errors

KINDS = ("mlp", "heads")
# The kind of a pipelined state's layer axis: each pipeline stage owns a run of layers.
LAYERS = "layers"
DEFAULT_NUM_WIDTHS = 4


LayoutError = errors.LayoutError


def default_widths(capacity: int, num_widths: int = DEFAULT_NUM_WIDTHS,
                   zero: bool = False) -> tuple[int, ...]:
  """`num_widths` compute widths spread evenly up to `capacity`: ceil(k*C/n) for k = 1..n,
  after a width 0 (a branch that computes nothing, for drained devices) if `zero`."""
  if capacity < 1:
    raise LayoutError(f"capacity must be >= 1, got {capacity}")
  n = max(1, min(num_widths, capacity))
  return (0,) * zero + tuple(sorted({math.ceil(k * capacity / n) for k in range(1, n + 1)}))


def even_counts(num_units: int, num_devices: int) -> tuple[int, ...]:
  """Splits `num_units` as evenly as possible; the first devices get the remainder."""
  base, rem = divmod(num_units, num_devices)
  return tuple(base + (d < rem) for d in range(num_devices))


def proportional_counts(num_units: int, speeds: Sequence[float], minimum: int = 1,
                        maximum: int | None = None) -> tuple[int, ...]:
  """Splits `num_units` by speed so the slowest finisher is as fast as possible.

  Every device starts with `minimum` units; each further unit goes to the device that would
  finish it soonest ((count + 1) / speed smallest). This minimizes max(count / speed), which
  rounding the proportional shares does not (with a minimum it can hand a remainder to the
  slowest device).

  Args:
    num_units: U, the number of logical units to split.
    speeds: one relative speed per device (e.g. 1 / slowdown).
    minimum: the fewest units any device gets.
    maximum: optional most units any device gets (e.g. the capacity of a compiled bucket).

  Returns:
    Per-device counts that sum to `num_units`.
  """
  speeds = np.asarray(speeds, np.float64)
  if speeds.ndim != 1 or len(speeds) == 0 or np.any(~np.isfinite(speeds)) or np.any(speeds <= 0):
    raise LayoutError(f"speeds must be positive and finite, got {tuple(speeds.tolist())}")
  n = len(speeds)
  if minimum * n > num_units:
    raise LayoutError(f"cannot give {n} devices at least {minimum} of {num_units} units each")
  if maximum is not None and maximum * n < num_units:
    raise LayoutError(f"cannot split {num_units} units over {n} devices with at most {maximum} "
                      "each")
  counts = [minimum] * n
  heap = [((minimum + 1) / s, d) for d, s in enumerate(speeds)]
  heapq.heapify(heap)
  for _ in range(num_units - minimum * n):
    _, d = heapq.heappop(heap)
    counts[d] += 1
    if maximum is None or counts[d] < maximum:
      heapq.heappush(heap, ((counts[d] + 1) / speeds[d], d))
  return tuple(counts)


def bucketed_counts(num_units: int, speeds: Sequence[float], widths: Sequence[int],
                    offset: float = 0.0, minimum: int = 1) -> tuple[int, ...]:
  """Splits `num_units` by speed when each device executes at a compiled bucket width.

  A device owning c units runs at the smallest width >= c, so rounding proportional counts can
  land a device just above a width and waste most of a bucket. This picks the smallest finishing
  time T = (width + offset) / speed at which the widths allowed by T (the largest width w with
  (w + offset) / speed <= T on each device) hold every unit, then takes the surplus off the
  devices with the largest (count + offset) / speed. `offset` is work every device that owns
  units repeats at its own speed, in units: with it the split balances time rather than units,
  and a slow device gets less than its proportional share (water-filling). No device exceeds
  max(widths).

  Args:
    num_units: U; speeds: one positive speed per device; widths: the compiled widths (any order;
      a width 0 is ignored); offset: repeated work per device, in units (>= 0).
    minimum: 1, every device keeps a unit; 0, a device may be left with none (drained: no
      units and no repeated work) where that finishes sooner.
  """
  speeds = np.asarray(speeds, np.float64)
  if speeds.ndim != 1 or len(speeds) == 0 or np.any(~np.isfinite(speeds)) or np.any(speeds <= 0):
    raise LayoutError(f"speeds must be positive and finite, got {tuple(speeds.tolist())}")
  if not (math.isfinite(offset) and offset >= 0):
    raise LayoutError(f"offset must be finite and >= 0, got {offset}")
  if minimum not in (0, 1):
    raise LayoutError(f"minimum must be 0 or 1, got {minimum}")
  n, ws = len(speeds), sorted(set(int(w) for w in widths if w > 0))
  if n * minimum > num_units or ws[-1] * n < num_units:
    raise LayoutError(f"cannot split {num_units} units over {n} devices with widths {tuple(ws)}")
  for t in sorted({(w + offset) / s for w in ws for s in speeds}):
    allow = [max((w for w in ws if (w + offset) / s <= t * (1 + 1e-12)), default=0)
             for s in speeds]
    if min(allow) >= minimum and sum(allow) >= num_units:
      break
  counts = list(allow)
  for _ in range(sum(counts) - num_units):
    d = max((i for i in range(n) if counts[i] > minimum),
            key=lambda i: (counts[i] + offset) / speeds[i])
    counts[d] -= 1
  return tuple(counts)


@dataclasses.dataclass(frozen=True)
class UnitLayout:
  """Which logical units of one kind every tensor device owns and computes (see module doc)."""

  kind: str
  num_units: int
  owned: tuple[tuple[int, ...], ...]
  capacity: int
  active: tuple[int, ...]
  widths: tuple[int, ...]

  def __post_init__(self):
    f = f"layout.{self.kind}"
    if self.kind not in KINDS + (LAYERS,):
      raise LayoutError(f"layout kind must be one of {KINDS + (LAYERS,)}, got {self.kind!r}")
    if self.num_units < 1:
      raise LayoutError(f"{f}: the model has {self.num_units} units; need at least 1")
    n = len(self.owned)
    if n < 1:
      raise LayoutError(f"{f}.owned: no devices")
    counts = tuple(len(o) for o in self.owned)
    if sum(counts) != self.num_units:
      raise LayoutError(
          f"{f}.counts: owned counts {counts} sum to {sum(counts)}, but the model has "
          f"{self.num_units} {self.kind} units")
    owner = {}
    for d, units in enumerate(self.owned):
      for u in units:
        if not 0 <= u < self.num_units:
          raise LayoutError(f"{f}.owned: device {d} owns unit {u}, outside [0, {self.num_units})")
        if u in owner:
          raise LayoutError(f"{f}.owned: unit {u} is owned by devices {owner[u]} and {d}")
        owner[u] = d
    # Counts summing to U with no unit owned twice means every unit is owned exactly once.
    if self.capacity < max(counts) or self.capacity < 1:
      d = int(np.argmax(counts))
      raise LayoutError(
          f"{f}.capacity: device {d} owns {counts[d]} units, more than capacity {self.capacity}")
    if len(self.active) != n:
      raise LayoutError(f"{f}.active: {len(self.active)} entries for {n} devices")
    for d, (a, c) in enumerate(zip(self.active, counts)):
      if not 0 <= a <= c:
        raise LayoutError(f"{f}.active: device {d} has active={a}, outside [0, owned={c}]")
    w = self.widths
    if (not w or any(x < 0 for x in w) or list(w) != sorted(set(w)) or w[-1] != self.capacity):
      raise LayoutError(
          f"{f}.widths: {w} must be distinct ascending widths (0 or more) ending at capacity "
          f"{self.capacity}")

  # --- constructors -------------------------------------------------------------------------

  @classmethod
  def from_counts(cls, kind: str, counts: Sequence[int], *, capacity: int | None = None,
                  widths: Sequence[int] | None = None,
                  num_widths: int = DEFAULT_NUM_WIDTHS) -> "UnitLayout":
    """A contiguous device-major layout: device d owns the next `counts[d]` logical units.

    Default widths: `default_widths`, with the width 0 when a device owns none."""
    counts = tuple(int(c) for c in counts)
    if any(c < 0 for c in counts):
      raise LayoutError(f"layout.{kind}.counts: negative count in {counts}")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int)
    owned = tuple(tuple(range(s, s + c)) for s, c in zip(starts, counts))
    capacity = max(max(counts, default=0), 1) if capacity is None else int(capacity)
    widths = (default_widths(capacity, num_widths, zero=0 in counts) if widths is None
              else tuple(widths))
    return cls(kind, sum(counts), owned, capacity, counts, widths)

  @classmethod
  def even(cls, kind: str, num_units: int, num_devices: int, **kw) -> "UnitLayout":
    """Every device owns num_units / num_devices units (the first ones one more if uneven)."""
    return cls.from_counts(kind, even_counts(num_units, num_devices), **kw)

  @classmethod
  def canonical(cls, kind: str, num_units: int, num_devices: int) -> "UnitLayout":
    """The layout of the sharded *logical* form: device d owns units [d*C, (d+1)*C) in order,
    C = ceil(U / N) (the last devices may own fewer, or none). Its padded arrays are the logical
    arrays with zeros appended up to N*C units (none when N divides U)."""
    c = -(-num_units // num_devices)
    counts = [min(c, max(0, num_units - d * c)) for d in range(num_devices)]
    return cls.from_counts(kind, counts, capacity=c, widths=(c,))

  def replace(self, **changes) -> "UnitLayout":
    return dataclasses.replace(self, **changes)

  def with_active(self, active: Sequence[int]) -> "UnitLayout":
    return self.replace(active=tuple(int(a) for a in active))

  # --- derived quantities -------------------------------------------------------------------

  @property
  def num_devices(self) -> int:
    return len(self.owned)

  @property
  def counts(self) -> tuple[int, ...]:
    return tuple(len(o) for o in self.owned)

  @property
  def num_slots(self) -> int:
    """N*C, the global length of the padded unit axis."""
    return self.num_devices * self.capacity

  def executed_widths(self) -> tuple[int, ...]:
    """The compute width each device executes: the smallest bucket width >= its active count."""
    return tuple(next(w for w in self.widths if w >= a) for a in self.active)

  def slot_units(self) -> np.ndarray:
    """int32 [N*C]: the logical unit in each padded slot, -1 for padding."""
    out = np.full(self.num_slots, -1, np.int32)
    for d, units in enumerate(self.owned):
      out[d * self.capacity: d * self.capacity + len(units)] = units
    return out

  def unit_slots(self) -> np.ndarray:
    """int32 [U]: the padded slot of each logical unit (the inverse of `slot_units`)."""
    out = np.empty(self.num_units, np.int32)
    su = self.slot_units()
    valid = su >= 0
    out[su[valid]] = np.nonzero(valid)[0]
    return out

  def owned_mask(self) -> np.ndarray:
    """bool [N*C]: True where a slot holds an owned unit (False on padding)."""
    return self.slot_units() >= 0

  def active_mask(self) -> np.ndarray:
    """bool [N*C]: True where a slot is computed this step."""
    s = np.arange(self.capacity)
    return np.concatenate([s < a for a in self.active])

  # --- packing ------------------------------------------------------------------------------

  def pack(self, x, axis: int, unit_size: int = 1):
    """Logical array (U*unit_size along `axis`) -> padded device-major (N*C*unit_size)."""
    return pack_axis(x, jnp.asarray(self.slot_units()), axis, unit_size, self.num_units)

  def unpack(self, x, axis: int, unit_size: int = 1):
    """Padded device-major array (N*C*unit_size along `axis`) -> logical (U*unit_size)."""
    return unpack_axis(x, jnp.asarray(self.unit_slots()), axis, unit_size)


def _elements(unit_index, unit_size):
  """Unit indices [K] -> element indices [K*unit_size] (unit k covers [k*u, (k+1)*u))."""
  return (unit_index[:, None] * unit_size + jnp.arange(unit_size)).reshape(-1)


def pack_axis(x, slot_units, axis, unit_size, num_units):
  """Gathers logical units into padded slots; `slot_units` [N*C] may be traced (no recompiles).

  Padding slots (-1) read out of range and are filled with zeros.
  """
  src = jnp.where(slot_units >= 0, slot_units, num_units)
  return jnp.take(x, _elements(src, unit_size), axis=axis, mode="fill", fill_value=0)


def unpack_axis(x, unit_slots, axis, unit_size):
  """Gathers padded slots back into logical unit order; `unit_slots` [U] may be traced."""
  return jnp.take(x, _elements(unit_slots, unit_size), axis=axis, mode="clip")


@dataclasses.dataclass(frozen=True)
class Layout:
  """The unit layouts of both kinds for a model on a `tensor` axis of N devices."""

  mlp: UnitLayout
  heads: UnitLayout

  def __post_init__(self):
    if self.mlp.kind != "mlp" or self.heads.kind != "heads":
      raise LayoutError(f"layout kinds must be ('mlp', 'heads'), got ({self.mlp.kind!r}, "
                        f"{self.heads.kind!r})")
    if self.mlp.num_devices != self.heads.num_devices:
      raise LayoutError(
          f"layout.heads: {self.heads.num_devices} devices, but layout.mlp has "
          f"{self.mlp.num_devices}; both must match the tensor axis")

  @classmethod
  def for_model(cls, *, d_model: int, num_heads: int, d_ff: int, num_devices: int,
                mlp="even", heads="even", capacity: dict | None = None,
                num_widths: int = DEFAULT_NUM_WIDTHS) -> "Layout":
    """Builds and checks a layout for a transformer.

    Args:
      d_model: model width.
      num_heads: attention heads (must divide d_model).
      d_ff: MLP hidden units.
      num_devices: N, devices on the tensor axis.
      mlp, heads: "even", or a sequence of N owned-unit counts.
      capacity: optional {"mlp": C, "heads": C} to pad above the largest count.
      num_widths: how many compute widths to compile per kind.
    """
    if num_heads < 1 or d_model % num_heads:
      raise LayoutError(
          f"model.num_heads: {num_heads} heads do not divide the model width d_model={d_model}")
    capacity = dict(capacity or {})
    kinds = {}
    for kind, spec, units in (("mlp", mlp, d_ff), ("heads", heads, num_heads)):
      if isinstance(spec, str):
        if spec != "even":
          raise LayoutError(f"layout.{kind}: {spec!r} is not 'even' or a tuple of counts")
        if units < num_devices:
          raise LayoutError(
              f"layout.{kind}: {units} {kind} units cannot be split over {num_devices} devices "
              "with at least one each; give explicit counts")
        counts = even_counts(units, num_devices)
      else:
        counts = tuple(int(c) for c in spec)
        if len(counts) != num_devices:
          raise LayoutError(
              f"layout.{kind}: {len(counts)} counts {counts} for {num_devices} tensor devices")
        if sum(counts) != units:
          raise LayoutError(
              f"layout.{kind}: counts {counts} sum to {sum(counts)}, but the model has {units} "
              f"{kind} units")
      kinds[kind] = UnitLayout.from_counts(
          kind, counts, capacity=capacity.pop(kind, None), num_widths=num_widths)
    if capacity:
      raise LayoutError(f"layout.capacity: unknown kinds {sorted(capacity)}; use {KINDS}")
    return cls(**kinds)

  @property
  def num_devices(self) -> int:
    return self.mlp.num_devices

  def drained(self) -> tuple[int, ...]:
    """The devices that own no units of any kind (a drained device: its blocks compute nothing
    where width 0 is compiled)."""
    return tuple(d for d in range(self.num_devices)
                 if all(u.counts[d] == 0 for u in self.kinds().values()))

  @classmethod
  def canonical(cls, num_units: dict, num_devices: int) -> "Layout":
    """The sharded logical form's layout of both kinds (`UnitLayout.canonical`)."""
    return cls(**{k: UnitLayout.canonical(k, num_units[k], num_devices) for k in KINDS})

  def kinds(self) -> dict[str, UnitLayout]:
    return {"mlp": self.mlp, "heads": self.heads}

  def replace(self, **kinds: UnitLayout) -> "Layout":
    return dataclasses.replace(self, **kinds)

  def bucket(self) -> tuple:
    """The compiled-variant key: capacities and compute widths (shapes), not counts or actives."""
    return tuple((k, u.capacity, u.widths) for k, u in self.kinds().items())

  def check_bucket(self, known) -> None:
    """Raises unless this layout's bucket is one of `known` (e.g. the precompiled variants)."""
    known = list(known)
    if self.bucket() not in known:
      caps = sorted({tuple(c for _, c, _ in b) for b in known})
      raise LayoutError(
          f"layout.capacity: bucket {self.bucket()} is not compiled; known (mlp, heads) "
          f"capacities: {caps}")

  def to_json(self) -> dict:
    """A JSON-able description (stored beside checkpoints)."""
    return {k: {"num_units": u.num_units, "owned": [list(o) for o in u.owned],
                "capacity": u.capacity, "active": list(u.active), "widths": list(u.widths)}
            for k, u in self.kinds().items()}

  @classmethod
  def from_json(cls, d: dict) -> "Layout":
    return cls(**{k: UnitLayout(k, v["num_units"], tuple(tuple(o) for o in v["owned"]),
                                v["capacity"], tuple(v["active"]), tuple(v["widths"]))
                  for k, v in d.items()})
