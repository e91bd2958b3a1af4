"""Lossless migration: move unit ownership between tensor devices with one compiled program.

A migration takes a padded state from layout A to layout B (same units, new owners, counts or
slot order). Only units whose owner changes travel; units that stay may change slot (compaction)
with a local gather. Per unit kind, on every tensor device d:

  1. gather the staying units into their new slots (the rest is zero);
  2. for r = 1 .. N-1: gather the (at most K = `chunk`) units d sends to device d + r into a
     buffer [K, ...], `ppermute` it (every device sends to d + r and receives from d - r, mod N)
     and scatter the received units into their slots. The leaves of a kind (weights, biases and
     optimizer moments of every layer) of one dtype share each round's buffer, so there are N-1
     ppermutes per (kind, dtype), none for a kind with K = 0. Rounds are chained, so every device
     enters them in the same order and one round's buffer is gone before the next: a round holds
     K units, where one `all_to_all` of the same bytes would hold N*K at once.

Exact copies only: A -> B -> A returns the padded state bit for bit, and padding stays zero.
The wire carries N*(N-1)*K slots per kind (`KindMoves.wire_slots`).

What compiles: the index arrays (`MovePlan`) are data of fixed shape, sharded over `tensor`, so
one executable serves every A -> B pair with the same capacities (C_A, C_B) and chunk K per kind.
`chunk=None` takes K = min(C_A, C_B), which fits any migration: one executable per pair of
buckets, but as many bytes as an all-gather of the padded state whatever moves. `chunk="sized"`
takes the smallest of three sizes (`chunk_sizes`: a sixteenth, a quarter or all of the smaller
capacity) that fits the busiest device pair: the bytes on the wire follow the units that change
owner, and warm-up compiles every size (`Engine.compile_moves`). `chunk="tight"` takes the
smallest power of two that fits (at most log2(C) + 2 executables per kind).

A bucket switch (C_B != C_A) is the same program at other shapes, and moves only the units that
change owner. The sharded logical form of a state is its padded form in the canonical layout
(`Layout.canonical`), so packing, unpacking and checkpoints are migrations too.
`Migrator.move_groups` runs a migration group by group of leaves (one transformer block's MLP
weights, then their Adam moments, ...), donating each group: a device then holds the state plus
one group's old copy and one round's buffers at most, where one program for the whole tree would
hold the old and the new state at once when C_B != C_A. Each group's program finishes before the
next is dispatched: that is what bounds the memory, and on XLA:CPU with several devices in one
process a burst of collective programs dispatched ahead (tiny ones, back to back) now and then
deadlocks the devices' threads until XLA aborts the process ("Termination timeout for `collective
permute`"); one program in flight never did (`_copy_leaves` waits the same way).

`ragged_all_to_all` would send exactly the moved units in one collective, but XLA:CPU does not
implement it, so the fixed-chunk rounds are the portable path built and tested here.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import layout as layout_lib
from semijax.core import memory
from semijax.core import mesh as mesh_lib
from semijax.core import sharding

LayoutError = layout_lib.LayoutError


# --- planning (host, numpy) -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KindMoves:
  """The moves of one unit kind from layout A to layout B (host arrays, global).

  Attributes:
    kind: "mlp", "heads" or "layers" (a pipelined state's layers, over `pipe`).
    capacity_from, capacity_to: C_A and C_B.
    chunk: K, slots per (source, destination) device pair in the exchange.
    send: int32 [N, N*K]: row d, entry t*K + k is device d's local slot (under A) of the k-th
      unit it sends to device t; C_A means nothing (a zero-filled slot).
    keep: int32 [N, C_B]: for each slot of device d under B, the local slot under A of the unit
      that stays there; C_A for a received unit or padding (zero).
    place: int32 [N, N*K]: the slot under B of the unit received at entry s*K + k (from device
      s); C_B means nothing (dropped).
    pairs: int32 [N, N]: units moved from device d to device t (zero diagonal).
    With `plan_stages`, every array has a leading dimension of pipeline stages ([P, N, ...]):
    each stage's tensor group moves its own units.
  """

  kind: str
  capacity_from: int
  capacity_to: int
  chunk: int
  send: np.ndarray
  keep: np.ndarray
  place: np.ndarray
  pairs: np.ndarray

  @property
  def moved(self) -> int:
    """Units that change owner."""
    return int(self.pairs.sum())

  @property
  def num_devices(self) -> int:
    return self.pairs.shape[-1]

  @property
  def groups(self) -> int:
    """How many device groups exchange independently (pipeline stages; 1 without)."""
    return int(np.prod(self.pairs.shape[:-2], dtype=np.int64))

  @property
  def wire_slots(self) -> int:
    """Unit slots the exchange carries between distinct devices: N*(N-1)*K per group."""
    n = self.num_devices
    return self.groups * n * (n - 1) * self.chunk


@dataclasses.dataclass(frozen=True)
class Moves:
  """A validated migration from layout `src` to layout `dst` (see `plan`)."""

  src: layout_lib.Layout
  dst: layout_lib.Layout
  kinds: dict  # {kind: KindMoves}

  def key(self, kinds=None) -> tuple:
    """What the compiled collective depends on: ((kind, C_A, C_B, K), ...), for `kinds` (default
    all; a tree holding one kind's leaves depends on that kind's entry only)."""
    return tuple((k, m.capacity_from, m.capacity_to, m.chunk) for k, m in self.kinds.items()
                 if kinds is None or k in kinds)

  def units_moved(self) -> dict:
    return {k: m.moved for k, m in self.kinds.items()}

  def changing_kinds(self) -> tuple[str, ...]:
    """The kinds whose padded arrays may change: the exchange carries slots (K > 0), or the
    capacity changes; a kind with neither is left as it is."""
    return tuple(k for k, m in self.kinds.items()
                 if m.chunk or m.capacity_from != m.capacity_to)


def _tight_chunk(need: int, limit: int) -> int:
  return min(limit, 1 << max(0, int(need - 1).bit_length())) if need else 0


# The chunk sizes of `chunk="sized"`, as shares of the smaller capacity: few enough that warm-up
# compiles every one (three per unit kind and pair of buckets), fine enough that a small move
# sends a sixteenth of what chunk=None (an all-gather's worth) sends.
CHUNK_SHARES = (1 / 16, 1 / 4, 1)


def chunk_sizes(limit: int) -> tuple[int, ...]:
  """The chunk sizes `chunk="sized"` picks from for a smaller capacity `limit` (ascending)."""
  return tuple(sorted({max(1, math.ceil(f * limit)) for f in CHUNK_SHARES}))


def _sized_chunk(need: int, limit: int) -> int:
  return next(k for k in chunk_sizes(limit) if k >= need) if need else 0


def chunk_options(a: layout_lib.Layout, b: layout_lib.Layout) -> list[dict]:
  """The {kind: K} of every migration from `a`'s bucket to `b`'s that `chunk="sized"` may give
  (what warm-up compiles): K = 0 for every kind (nothing moves), then each kind's `chunk_sizes`
  in step (a kind with fewer sizes repeats its largest)."""
  sizes = {k: chunk_sizes(min(u.capacity, b.kinds()[k].capacity)) for k, u in a.kinds().items()}
  return [{k: 0 for k in sizes}] + [{k: v[min(i, len(v) - 1)] for k, v in sizes.items()}
                                    for i in range(max(len(v) for v in sizes.values()))]


def same_owners(a: layout_lib.Layout, b: layout_lib.Layout) -> tuple:
  """(A, B): one set of owners in `a`'s capacities and widths and in `b`'s (a migration between
  their buckets that moves nothing): `a`'s owners where they fit `b`'s capacities, else `b`'s."""
  fits = all(max(u.counts) <= b.kinds()[k].capacity for k, u in a.kinds().items())
  owners = a if fits else b
  at = lambda c: layout_lib.Layout(**{k: u.replace(capacity=c.kinds()[k].capacity,
                                                   widths=c.kinds()[k].widths)
                                      for k, u in owners.kinds().items()})
  return at(a), at(b)


def _kind_moves(a: layout_lib.UnitLayout, b: layout_lib.UnitLayout, chunk) -> KindMoves:
  n, f = a.num_devices, f"migration.chunk.{a.kind}"
  owner_a = np.empty(a.num_units, np.int64)
  local_a = np.empty(a.num_units, np.int64)
  for d, units in enumerate(a.owned):
    owner_a[list(units)] = d
    local_a[list(units)] = np.arange(len(units))
  # Units each pair sends, in the destination's slot order (deterministic).
  lists = [[[] for _ in range(n)] for _ in range(n)]
  for d, units in enumerate(b.owned):
    for u in units:
      if owner_a[u] != d:
        lists[owner_a[u]][d].append(u)
  pairs = np.array([[len(lists[s][t]) for t in range(n)] for s in range(n)], np.int32)
  limit = min(a.capacity, b.capacity)
  if chunk is None:
    k = limit
  elif chunk == "tight":
    k = _tight_chunk(int(pairs.max()), limit)
  elif chunk == "sized":
    k = _sized_chunk(int(pairs.max()), limit)
  else:
    k = int(chunk)
    if k < 0:
      raise LayoutError(f"{f}: must be >= 0, got {chunk!r}")
    if pairs.max() > k:
      s, t = np.unravel_index(int(np.argmax(pairs)), pairs.shape)
      raise LayoutError(f"{f}: device {s} sends {pairs[s, t]} units to device {t}, more than "
                        f"chunk {k}; use a larger chunk or chunk=None")
  send = np.full((n, n * k), a.capacity, np.int32)
  place = np.full((n, n * k), b.capacity, np.int32)
  slot_b = {u: slot for units in b.owned for slot, u in enumerate(units)}
  for s in range(n):
    for t in range(n):
      for i, u in enumerate(lists[s][t]):
        send[s, t * k + i] = local_a[u]
        place[t, s * k + i] = slot_b[u]
  keep = np.full((n, b.capacity), a.capacity, np.int32)
  for d, units in enumerate(b.owned):
    for slot, u in enumerate(units):
      if owner_a[u] == d:
        keep[d, slot] = local_a[u]
  return KindMoves(a.kind, a.capacity, b.capacity, k, send, keep, place, pairs)


def plan(src: layout_lib.Layout, dst: layout_lib.Layout, *, chunk=None,
         max_capacity: dict | None = None) -> Moves:
  """Validates a layout change and computes its moves (host only; nothing is compiled or moved).

  Args:
    src, dst: layouts A and B of the same model on the same tensor devices.
    chunk: None (K = min(C_A, C_B): one executable per capacity pair), "tight" (smallest power
      of two that fits, 0 if nothing moves), "sized" (the smallest of `chunk_sizes(min(C_A,
      C_B))` that fits, 0 if nothing moves: a few sizes, all compiled ahead of time), an int for
      every kind, or {kind: any of those}.
    max_capacity: optional {kind: largest compiled capacity}; B above it is refused.

  Raises:
    LayoutError: naming the field: `layout` (device count), `layout.<kind>.num_units` (units
      lost or added), `layout.<kind>.capacity` (above the largest bucket), `migration.chunk.<kind>`.
  """
  if src.num_devices != dst.num_devices:
    raise LayoutError(f"layout: the new layout has {dst.num_devices} devices, the current one "
                      f"{src.num_devices}; migration keeps the tensor devices")
  chunks = chunk if isinstance(chunk, dict) else {k: chunk for k in layout_lib.KINDS}
  max_capacity = dict(max_capacity or {})
  kinds = {}
  for kind, a in src.kinds().items():
    b = dst.kinds()[kind]
    if b.num_units != a.num_units:
      raise LayoutError(f"layout.{kind}.num_units: the new layout has {b.num_units} units, the "
                        f"current one {a.num_units}; a migration cannot lose or add units")
    if kind in max_capacity and b.capacity > max_capacity[kind]:
      d = int(np.argmax(b.counts))
      raise LayoutError(
          f"layout.{kind}.capacity: {b.capacity} (device {d} owns {b.counts[d]} units) is above "
          f"the largest bucket {max_capacity[kind]}")
    kinds[kind] = _kind_moves(a, b, chunks.get(kind))
  return Moves(src, dst, kinds)


def plan_stages(srcs, dsts, *, chunk="sized") -> Moves:
  """The moves of every pipeline stage's own unit layout, stage s from `srcs[s]` to `dsts[s]`.

  One `Moves` whose index arrays have a leading stage dimension ([P, N, ...], placed over
  (pipe, tensor)): each stage's tensor group exchanges its own units, all with the chunk the
  busiest stage needs (so one program serves them). `src` and `dst` are stage 0's layouts.

  Raises:
    LayoutError: stages whose layouts differ in capacities (`plan` names the rest).
  """
  if len(srcs) != len(dsts) or not srcs:
    raise LayoutError(f"layout.stages: {len(srcs)} source and {len(dsts)} target stage layouts")
  per = [plan(a, b, chunk=chunk) for a, b in zip(srcs, dsts)]
  capacities = {tuple((k, v.capacity_from, v.capacity_to) for k, v in m.kinds.items())
                for m in per}
  if len(capacities) != 1:
    raise LayoutError("layout.stages: every stage's layouts must share their capacities")
  chunks = {k: max(m.kinds[k].chunk for m in per) for k in per[0].kinds}
  per = [plan(a, b, chunk=chunks) for a, b in zip(srcs, dsts)]
  kinds = {k: KindMoves(k, m.capacity_from, m.capacity_to, m.chunk,
                        *(np.stack([getattr(q.kinds[k], f) for q in per])
                          for f in ("send", "keep", "place", "pairs")))
           for k, m in per[0].kinds.items()}
  return Moves(srcs[0], dsts[0], kinds)


def plan_layers(src: layout_lib.UnitLayout, dst: layout_lib.UnitLayout, *,
                chunk="sized") -> Moves:
  """The moves of a pipelined state's layers between stages (kind "layers", over `pipe`): rows
  of the stacked layer axis change stage, with all their units as they are."""
  for u in (src, dst):
    if u.kind != layout_lib.LAYERS:
      raise LayoutError(f"layout.layers: expected a {layout_lib.LAYERS!r} layout, got {u.kind!r}")
  if src.num_devices != dst.num_devices or src.num_units != dst.num_units:
    raise LayoutError(f"layout.layers: {src.num_units} layers on {src.num_devices} stages cannot "
                      f"become {dst.num_units} on {dst.num_devices}")
  return Moves(src, dst, {layout_lib.LAYERS: _kind_moves(src, dst, chunk)})


def move_units(layout: layout_lib.Layout, moves: dict, *,
               capacities: dict | None = None) -> layout_lib.Layout:
  """A new layout in which the given units change owner; every unit becomes active.

  The receiving device appends a unit after its own; the sender closes the gap (compaction).

  Args:
    layout: the current layout.
    moves: {kind: [(unit, new owner), ...]}.
    capacities: optional {kind: ascending capacity buckets}. If a device would exceed the
      current capacity, the smallest bucket that fits is used; without it, overflow is refused.

  Raises:
    LayoutError: `layout.<kind>.owned` for a bad unit or device, `layout.<kind>.capacity` when no
      bucket fits.
  """
  new = {}
  for kind, u in layout.kinds().items():
    owned = [list(o) for o in u.owned]
    owner = {x: d for d, o in enumerate(owned) for x in o}
    for unit, dst in moves.get(kind, ()):
      if unit not in owner:
        raise LayoutError(f"layout.{kind}.owned: unit {unit} is not in [0, {u.num_units})")
      if not 0 <= dst < u.num_devices:
        raise LayoutError(f"layout.{kind}.owned: device {dst} is not in [0, {u.num_devices})")
      if owner[unit] != dst:
        owned[owner[unit]].remove(unit)
        owned[dst].append(unit)
        owner[unit] = dst
    counts = [len(o) for o in owned]
    capacity, widths = u.capacity, u.widths
    if max(counts) > capacity:
      fits = [c for c in (capacities or {}).get(kind, ()) if c >= max(counts)]
      if not fits:
        d = int(np.argmax(counts))
        raise LayoutError(
            f"layout.{kind}.capacity: device {d} would own {counts[d]} units, above capacity "
            f"{capacity} and every bucket in {tuple((capacities or {}).get(kind, ()))}")
      capacity = min(fits)
      widths = layout_lib.default_widths(capacity, len(u.widths))
    new[kind] = layout_lib.UnitLayout(kind, u.num_units, tuple(tuple(o) for o in owned),
                                      capacity, tuple(counts), widths)
  return layout_lib.Layout(**new)


# --- execution (one jitted shard_map) ---------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass, data_fields=("send", "keep", "place"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class MovePlan:
  """Device-placed index arrays of a `Moves`: {kind: int32 [N, ...]} split over the kind's mesh
  axis (`AXIS_OF`), or [P, N, ...] split over (pipe, tensor) when every pipeline stage moves its
  own units (`stack_stages`)."""

  send: dict
  keep: dict
  place: dict


# The mesh axis each kind's units are split over: tensor-parallel units over `tensor`, a
# pipelined state's layers (`layout.LAYERS`) over `pipe`.
AXIS_OF = {"mlp": mesh_lib.TENSOR, "heads": mesh_lib.TENSOR, layout_lib.LAYERS: mesh_lib.PIPE}


def _unit_leaves(axes, kinds=layout_lib.KINDS):
  """[(index into leaves, axis, kind)] for every leaf with a unit axis of one of `kinds`."""
  out = []
  for i, a in enumerate(jax.tree.leaves(axes)):
    if (unit := a.unit(tuple(kinds))) is not None:
      out.append((i, *unit))
  return out


def _kinds(axes, kinds=layout_lib.KINDS) -> set:
  """The unit kinds (among `kinds`) of the leaves of an `Axes` tree."""
  return {kind for _, _, kind in _unit_leaves(axes, kinds)}


def _elements(slots, unit_size):
  """Unit slots [K] -> entry indices [K*unit_size] along a unit axis."""
  return (slots[:, None] * unit_size + jnp.arange(unit_size)).reshape(-1)


def _on_axis(axis, idx):
  return (slice(None),) * axis + (idx,)


def _local_migrate(leaves, plan: MovePlan, *, units, unit_sizes, key):
  """Runs inside shard_map on local blocks (see module doc).

  Args:
    leaves: local arrays; a unit leaf has C_A*unit_size entries on its unit axis.
    plan: local index arrays per kind (this device's row, with leading singleton dimensions):
      send [N*K], keep [C_B], place [N*K] (N: devices on the kind's axis).
    units: [(leaf index, unit axis, kind)] (static).
    key: ((kind, C_A, C_B, K), ...) (static).

  Returns:
    The local leaves with C_B*unit_size entries on unit axes (other leaves unchanged).
  """
  out = list(leaves)
  last = None
  for kind, _, _, chunk in key:
    u = unit_sizes.get(kind)
    members = [(i, axis) for i, axis, k in units if k == kind]
    for i, axis in members:           # staying units into their new slots, zeros elsewhere
      out[i] = jnp.take(leaves[i], _elements(plan.keep[kind].reshape(-1), u), axis=axis,
                        mode="fill", fill_value=0)
    if not chunk or not members:
      continue
    # Group the kind's leaves by dtype; each group exchanges its units in N-1 rounds of ppermute,
    # round r sending device d's chunk for device d + r (mod N): a round's buffers hold K units
    # (where one all_to_all would hold N*K at once).
    groups: dict = {}
    for i, axis in members:
      groups.setdefault(jnp.dtype(leaves[i].dtype), []).append((i, axis))
    send_row, place_row = plan.send[kind].reshape(-1), plan.place[kind].reshape(-1)
    n = send_row.shape[0] // chunk
    axis_name = AXIS_OF[kind]
    me = jax.lax.axis_index(axis_name)
    for group in groups.values():
      for r in range(1, n):
        send = _elements(jax.lax.dynamic_slice(send_row, ((me + r) % n * chunk,), (chunk,)), u)
        place = _elements(jax.lax.dynamic_slice(place_row, ((me - r) % n * chunk,), (chunk,)), u)
        parts = []
        for i, axis in group:           # [.., K*u, ..] -> [K, u * rest]
          x = jnp.take(leaves[i], send, axis=axis, mode="fill", fill_value=0)
          x = jnp.moveaxis(x, axis, 0)
          parts.append((x.shape[1:], x.reshape(x.shape[0] // u, -1)))
        buf = jnp.concatenate([p for _, p in parts], axis=1)                # [K, F]
        if last is not None:
          # Every device must enter the collectives in the same order (XLA:CPU runs independent
          # ones in any order per device, and a rendezvous then waits forever), and one round's
          # buffers should be gone before the next: chain them.
          buf, _ = jax.lax.optimization_barrier((buf, last))
        recv = last = jax.lax.ppermute(buf, axis_name,
                                       perm=[(d, (d + r) % n) for d in range(n)])  # [K, F]
        offsets = np.cumsum([0] + [p.shape[1] for _, p in parts])
        for (i, axis), (shape, _), lo, hi in zip(group, parts, offsets[:-1], offsets[1:]):
          got = jnp.moveaxis(recv[:, lo:hi].reshape(-1, *shape), 0, axis)
          out[i] = out[i].at[_on_axis(axis, place)].set(got, mode="drop")
  return out


def _signature(tree) -> tuple:
  return tuple((tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(tree))


class Migrator:
  """Executes `Moves` on padded trees of one mesh: one jitted shard_map program (N-1 ppermute
  rounds per unit kind and dtype), compiled once per (moves key, tree shapes).

  Args:
    mesh: the (data, tensor) mesh the padded trees live on.
    unit_sizes: {kind: entries per unit on the unit axis}, e.g. {"mlp": 1, "heads": head_dim}.
    donate: donate the input tree (saves a copy of the state; the input is then invalid).
  """

  def __init__(self, mesh: jax.sharding.Mesh, unit_sizes: dict, *, donate: bool = False):
    self.mesh, self.unit_sizes, self.donate = mesh, dict(unit_sizes), bool(donate)
    self._compiled: dict = {}
    self.compile_count = 0

  @classmethod
  def for_engine(cls, engine, **kw) -> "Migrator":
    return cls(engine.mesh, engine.unit_sizes, **kw)

  def device_plan(self, moves: Moves, kinds=None) -> MovePlan:
    """The index arrays of `moves` (of `kinds`, default all), placed on the mesh: split over the
    kind's axis, or over (pipe, tensor) for per-stage arrays."""
    def put(kind, x):
      spec = P(mesh_lib.PIPE, mesh_lib.TENSOR) if x.ndim == 3 else P(AXIS_OF[kind])
      return mesh_lib.put(x, self.mesh, spec)
    return MovePlan(*({k: put(k, getattr(m, f)) for k, m in moves.kinds.items()
                       if kinds is None or k in kinds} for f in ("send", "keep", "place")))

  def check(self, tree, axes, moves: Moves) -> None:
    """Raises LayoutError unless `tree` is a padded tree of `moves.src` on this mesh."""
    for kind, m in moves.kinds.items():
      n = self.mesh.shape[AXIS_OF[kind]]
      if m.num_devices != n:
        raise LayoutError(f"layout: {m.num_devices} devices, but mesh.{AXIS_OF[kind]} = {n}")
    if jax.tree.structure(axes) != jax.tree.structure(tree):
      raise LayoutError("migration.axes: the axes tree does not match the tree's structure")
    paths = jax.tree_util.tree_leaves_with_path(tree)
    for i, axis, kind in _unit_leaves(axes, moves.kinds):
      path, x = paths[i]
      size = self.unit_sizes.get(kind, 1 if kind == layout_lib.LAYERS else None)
      if size is None:
        raise LayoutError(f"migration.unit_sizes: no unit size for kind {kind!r}")
      want = moves.kinds[kind].num_devices * moves.kinds[kind].capacity_from * size
      if x.shape[axis] != want:
        raise LayoutError(
            f"migration.tree{jax.tree_util.keystr(path)}: unit axis {axis} has {x.shape[axis]} "
            f"entries, but the current layout's padded {kind} axis has N*C*unit = {want}")

  def _compiled_fn(self, tree, axes, moves: Moves, device_plan: MovePlan, donate: bool):
    units = _unit_leaves(axes, moves.kinds)
    moves_key = moves.key(_kinds(axes, moves.kinds))
    key = (moves_key, jax.tree.structure(tree), _signature(tree), tuple(jax.tree.leaves(axes)),
           donate)
    fn = self._compiled.get(key)
    if fn is not None:
      return fn
    leaf_specs = [a.spec() for a in jax.tree.leaves(axes)]
    treedef = jax.tree.structure(tree)
    plan_specs = jax.tree.map(lambda x: x.sharding.spec, device_plan)
    local = functools.partial(_local_migrate, units=units,
                              unit_sizes={layout_lib.LAYERS: 1, **self.unit_sizes}, key=moves_key)
    body = jax.shard_map(local, mesh=self.mesh, in_specs=(leaf_specs, plan_specs),
                         out_specs=leaf_specs)

    def run(tree, plan):
      return jax.tree.unflatten(treedef, body(jax.tree.leaves(tree), plan))

    out_sh = jax.tree.unflatten(treedef, [NamedSharding(self.mesh, s) for s in leaf_specs])
    abstract = lambda t: jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
    # XLA can write the output into a donated buffer only where the shape stays: a move whose
    # capacity changes is not donated (`move_groups` frees its old copy once it has moved).
    out = jax.eval_shape(run, abstract(tree), abstract(device_plan))
    donate = donate and all(a.shape == b.shape for a, b in zip(jax.tree.leaves(tree),
                                                                jax.tree.leaves(out)))
    jitted = jax.jit(run, out_shardings=out_sh, donate_argnums=(0,) if donate else ())
    fn = jitted.lower(abstract(tree), abstract(device_plan)).compile()
    self.compile_count += 1
    logging.info("compiled migration %s (%d variants)", moves_key, len(self._compiled) + 1)
    self._compiled[key] = fn
    return fn

  def compile(self, tree, axes, moves: Moves, *, donate: bool | None = None):
    """Compiles (ahead of time) the collective for `moves`' key and this tree's shapes; returns
    the compiled executable (e.g. to read its program with `.as_text()`)."""
    self.check(tree, axes, moves)
    donate = self.donate if donate is None else donate
    return self._compiled_fn(tree, axes, moves,
                             self.device_plan(moves, _kinds(axes, moves.kinds)), donate)

  def __call__(self, tree, axes, moves: Moves, *, donate: bool | None = None):
    """Moves a padded tree from layout `moves.src` to `moves.dst`.

    Args:
      tree: padded arrays (global, unit axes split over `tensor`) of layout A.
      axes: an `Axes` tree of the same structure; leaves without a unit axis are left as they are.
      moves: from `plan(A, B)`.

      donate: consume `tree` (default: the migrator's `donate`).

    Returns:
      The same tree in layout B (unit axes N*C_B*unit_size long, padding zero).
    """
    self.check(tree, axes, moves)
    donate = self.donate if donate is None else donate
    device_plan = self.device_plan(moves, _kinds(axes, moves.kinds))
    fn = self._compiled_fn(tree, axes, moves, device_plan, donate)
    memory.observe(fn)
    out = fn(tree, device_plan)
    if donate:       # freed now also where XLA could not reuse it for the output
      for x in jax.tree.leaves(tree):
        if not x.is_deleted():
          x.delete()
    return out

  def compile_groups(self, tree, axes, moves: Moves, groups, *, donate: bool = True) -> None:
    """Compiles (ahead of time) what `move_groups` runs for these arguments."""
    self.check(tree, axes, moves)
    leaves, axes_leaves = jax.tree.leaves(tree), jax.tree.leaves(axes)
    for group in groups:
      self.compile([leaves[i] for i in group], [axes_leaves[i] for i in group], moves,
                   donate=donate)

  def move_groups(self, tree, axes, moves: Moves, groups, *, donate: bool = True):
    """`self(tree, axes, moves)`, one group of leaves at a time (see module doc).

    Args:
      tree, axes, moves: as for `__call__`.
      groups: lists of leaf indices (into `jax.tree.leaves(tree)`) that move together; every
        unit leaf must be in one (`leaf_groups` makes them); other leaves stay as they are.
      donate: consume each group's old leaves as it moves (the other leaves are then shared by
        the input and the output).

    Returns:
      The tree in layout B. Groups whose leaves have the same shapes share one executable.
    """
    self.check(tree, axes, moves)
    leaves, treedef = jax.tree.flatten(tree)
    axes_leaves = jax.tree.leaves(axes)
    # Leaves that do not move are shared by the input and the output when the input is consumed;
    # otherwise copied, so that donating one tree later never deletes the other's buffers.
    out = list(leaves) if donate else _copy_leaves(leaves)
    for group in groups:
      moved = jax.block_until_ready(self([leaves[i] for i in group],
                                         [axes_leaves[i] for i in group], moves, donate=donate))
      for i, x in zip(group, moved):
        out[i] = x
    return jax.tree.unflatten(treedef, out)

  def migrate_state(self, state, moves: Moves, tx, axes):
    """Migrates an engine `TrainState` (parameters and every parameter-shaped optimizer leaf)."""
    return self(state, state_axes(state, tx, axes), moves)


def _copy_leaves(leaves: list) -> list:
  """Fresh copies of `leaves`, each with its leaf's sharding, in one program per set of devices
  (a tree may mix leaves on the mesh with leaves on one device). A copy per leaf (`x.copy()`)
  dispatched one small program per leaf: on XLA:CPU with 8 devices in one process such a burst
  now and then left a collective's device threads waiting until XLA aborted the process; each
  program here also finishes before the next is dispatched (see the module doc)."""
  by_devices: dict = {}
  for i, x in enumerate(leaves):
    by_devices.setdefault(frozenset(d.id for d in x.sharding.device_set), []).append(i)
  out = list(leaves)
  for group in by_devices.values():
    part = [leaves[i] for i in group]
    copied = jax.block_until_ready(_copier(tuple(x.sharding for x in part))(part))
    for i, y in zip(group, copied):
      out[i] = y
  return out


@functools.lru_cache(maxsize=32)
def _copier(shardings: tuple):
  """The jitted copy of leaves with `shardings` (one per leaf; the outputs keep them)."""
  return jax.jit(lambda leaves: [jnp.copy(x) for x in leaves], out_shardings=list(shardings))


def leaf_groups(tree, axes, kinds=layout_lib.KINDS, *, by_leaf: bool = False) -> list[list[int]]:
  """Leaf indices of `tree`'s unit leaves grouped by (sub-tree, transformer block, unit kind),
  in order: one block's MLP (or attention) weights move together, then their first Adam moments,
  then their second ones. The groups of every block and sub-tree have the same shapes, so they
  share one compiled program per kind. Leaves outside the blocks (none carry units in the models
  here) group by sub-tree and kind. `by_leaf`: one group per leaf (a pipelined state's stacked
  leaves, which hold every layer of a stage)."""
  if by_leaf:
    return [[i] for i, _, _ in _unit_leaves(axes, kinds)]
  groups: dict = {}
  paths = [p for p, _ in jax.tree_util.tree_leaves_with_path(tree)]
  for i, _, kind in _unit_leaves(axes, kinds):
    keys = [jax.tree_util.keystr((k,)) for k in paths[i]]
    cut = keys.index("['blocks']") if "['blocks']" in keys else len(keys) - 1
    groups.setdefault((tuple(keys[:cut]), sharding.block_index(paths[i]), kind), []).append(i)
  return list(groups.values())


def state_axes(state, tx, axes):
  """The `Axes` tree of a TrainState(params, opt_state): optimizer moments get their
  parameter's axes (`sharding.map_params`), other leaves (step counts) none."""
  none = lambda x: sharding.Axes((None,) * jnp.ndim(x))
  opt = sharding.map_params(tx, lambda x, a: a, state.opt_state, axes)
  opt = jax.tree.map(lambda x: x if isinstance(x, sharding.Axes) else none(x), opt)
  return dataclasses.replace(state, params=axes, opt_state=opt)


_MIGRATORS: dict = {}   # one Migrator (and compile cache) per (mesh, unit sizes)


def migrate(tree, axes, moves: Moves, *, mesh: jax.sharding.Mesh, unit_sizes: dict):
  """Functional form of `Migrator(mesh, unit_sizes)(tree, axes, moves)`, sharing compiles."""
  key = (mesh, tuple(sorted(unit_sizes.items())))
  if key not in _MIGRATORS:
    _MIGRATORS[key] = Migrator(mesh, unit_sizes)
  return _MIGRATORS[key](tree, axes, moves)


def payload_bytes(tree, axes, moves: Moves, unit_sizes: dict) -> dict:
  """{"moved": bytes of the units that change owner, "wire": bytes the exchange carries
  between distinct devices} for a padded tree of layout `moves.src` (summed over all leaves)."""
  per_unit = {k: 0 for k in moves.kinds}
  leaves = jax.tree.leaves(tree)
  for i, _, kind in _unit_leaves(axes, moves.kinds):
    x, m = leaves[i], moves.kinds[kind]
    per_unit[kind] += (x.size // (m.num_devices * m.capacity_from * m.groups)
                       * x.dtype.itemsize)
  moved = sum(per_unit[k] * m.moved for k, m in moves.kinds.items())
  wire = sum(per_unit[k] * m.wire_slots for k, m in moves.kinds.items())
  return {"moved": int(moved), "wire": int(wire), "per_unit": per_unit}
