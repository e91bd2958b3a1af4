"""The step plan: what every tensor device computes in one step, as data of a compiled step.

A `Plan` holds the per-device active counts, the resize arrays and the offload plans of one step
(data, split over `tensor`), and the compiled bucket widths and the width kernel (static).
Changing the data never recompiles; changing the static parts selects another compiled variant.
`executed_widths` says, on the host, what width every device executes in every block of a step:
what the emulated slowdown charges, and what a cost model counts.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import offload as offload_lib
from semijax.core import width_gemm


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("active", "resize", "offload"),
                   meta_fields=("widths", "kernel", "idle"))
@dataclasses.dataclass(frozen=True)
class Plan:
  """What every tensor device computes in one step.

  Attributes:
    active: {kind: int32 [N]} leading slots each device computes ([1] locally in shard_map).
    resize: a `resize.Resize` (ZERO-resizing: which units / features each device skips in each
      layer), or None for exact computation. Inside a block, `layer(i)` has sliced it to layer i.
    offload: {kind: `offload.OffloadPlan`} for every kind (the same in every layer), or None: which
      units each device sends to helpers and computes for others. Exact, so `exact()` keeps it.
    widths: ((kind, compute widths), ...), static: the compiled bucket widths.
    kernel: static, how a device of an exact block without offload computes its width when
      several are compiled (`width_gemm.KERNELS`): "switch" (`lax.switch` over `widths`),
      "pallas" (one program whose GEMMs skip the units past `active`) or "auto".
    idle: static, whether some device owns no unit of a kind that compiles the width 0 (a
      count 0 in a bucket without it computes the narrowest width): then a device without
      units of a kind skips the work that only feeds them, and a drained device (none of any
      kind) the embedding, the head and the loss, in conds (`core.repeated`). Static so that a
      step in which every device owns units has no conds: a layout with such a zero count
      compiles its own step (warm-up compiles it ahead where a policy may drain,
      `balance.warmup`).
  """

  active: dict
  widths: tuple
  resize: object = None
  offload: dict | None = None
  kernel: str = "auto"
  idle: bool = False

  def with_idle(self) -> "Plan":
    """The same plan compiled for devices without units (`idle`)."""
    return dataclasses.replace(self, idle=True)

  @property
  def may_idle(self) -> bool:
    """Static: whether a layout of this plan's bucket may leave a device without units of some
    kind (a kind compiles the width 0, without offload), so that its `idle` variant exists."""
    return self.offload is None and any(0 in w for _, w in self.widths)

  def runs_pallas(self, kind: str) -> bool:
    """Whether this plan's blocks of `kind` run the pallas kernel (`runs_pallas`)."""
    return runs_pallas(self.kernel, self.widths_of(kind), self.resize, self.offload)

  def widths_of(self, kind: str) -> tuple[int, ...]:
    return dict(self.widths)[kind]

  def layer(self, i: int) -> "Plan":
    """The plan of block i: resize arrays [N, L, ...] sliced to [N, ...] (or [1, ...] locally)."""
    if self.resize is None:
      return self
    return dataclasses.replace(self, resize=self.resize.layer(i))

  def exact(self) -> "Plan":
    """The same plan without resizing (evaluation always computes every owned unit).

    Offload is kept: it computes exactly the same values, and balances evaluation steps too.
    """
    return dataclasses.replace(self, resize=None)


def runs_pallas(kernel: str, widths: tuple, resize=None, offload=None) -> bool:
  """Whether a block with these compiled `widths` runs the pallas kernel rather than a
  `lax.switch` or one width: an exact block without offload, more than one width compiled, and
  `kernel` resolving to "pallas" on this backend (`width_gemm.resolve`)."""
  return (resize is None and offload is None and len(widths) > 1
          and width_gemm.resolve(kernel) == "pallas")


def uniform_widths(layout: layout_lib.Layout) -> dict | None:
  """{kind: (w,)} when, in every kind, every device executes the same bucket width w; else None.

  An exact step of such a layout needs no per-device branch: with these as the plan's widths
  it runs without `lax.switch` and without rematerializing the forward pass (about a third less
  block compute than the multi-width step of the same layout).
  """
  out = {}
  for kind, u in layout.kinds().items():
    executed = set(u.executed_widths())
    if len(executed) != 1:
      return None
    out[kind] = (executed.pop(),)
  return out


def make_plan(layout: layout_lib.Layout, mesh: jax.sharding.Mesh, *, resize=None, offload=None,
              widths: dict | None = None, kernel: str = "auto") -> Plan:
  """The device-placed plan for `layout` (every data leaf sharded over `tensor`).

  `resize` is a host-side `resize.Resize` (numpy leaves [N, L, ...]) or None.
  `offload` is None (no offload path) or {kind: {straggler: {helper: units}}}; a kind left out
  (or {}) offloads nothing but still runs the offload path, so that every amount, zero included,
  uses the same compiled step (`offload.static_shape`).
  `widths` ({kind: ascending compute widths}, default the layout's) narrows the compiled branches,
  e.g. to `uniform_widths(layout)`; the widest must cover every device's active count.
  `kernel` is the width kernel (`Plan.kernel`).

  Raises:
    ValueError: `offload` with an unknown kind, or together with `resize` (not supported);
      `widths` that do not cover an active count or exceed the capacity; an unknown `kernel`.
    LayoutError: `offload.<kind>` with a bad straggler, helper or share (`offload.make_plan`).
  """
  if offload is not None and resize is not None:
    raise ValueError("offload: cannot be combined with resize (a resized device's kept units "
                     "are a permutation, offload sends its last active slots); pass one of them")
  width_gemm.resolve(kernel)                 # names layout.kernel when it is not one of them
  kind_widths = _widths(layout, widths)
  put = lambda x: mesh_lib.put(x, mesh, P(mesh_lib.TENSOR))
  active = {k: put(np.asarray(u.active, np.int32)) for k, u in layout.kinds().items()}
  if resize is not None:
    resize = jax.tree.map(put, resize)
  if offload is not None:
    offload = _offload_plans(layout, mesh, offload)
  idle = offload is None and any(0 in u.counts and 0 in kind_widths[k]
                                 for k, u in layout.kinds().items())
  return Plan(active, tuple(kind_widths.items()), resize, offload, kernel, idle)


def _widths(layout: layout_lib.Layout, widths: dict | None) -> dict:
  """{kind: compiled widths}: the layout's, or `widths` checked against it (ValueError)."""
  kind_widths = {k: u.widths for k, u in layout.kinds().items()}
  for kind, w in (widths or {}).items():
    u = layout.kinds().get(kind)
    w = tuple(int(x) for x in w)
    if (u is None or not w or list(w) != sorted(set(w)) or w[0] < 0 or w[-1] > u.capacity
        or w[-1] < max(u.active)):
      raise ValueError(f"widths.{kind}: {w} must be ascending widths of a layout kind, at most "
                       f"its capacity and covering every active count ({layout.to_json()})")
    kind_widths[kind] = w
  return kind_widths


def executed_widths(layout: layout_lib.Layout, num_layers: int, *, resize=None, offload=None,
                    widths: dict | None = None, kernel: str = "auto") -> dict:
  """{kind: float64 [N, L]}: the width each tensor device executes in each layer's block.

  The host's mirror of what `tp.row_parallel` selects on the device (same arguments as
  `make_plan`, with the host `resize`): exact, the smallest compiled width >= its active count
  (under the pallas kernel, the active count itself: it skips the units past it);
  resized in units mode, that of its kept count; in contraction mode, its active width times
  the compiled keep fraction; with offload, the width >= what it keeps plus one chunk for every
  round in which it computes a straggler's units.
  """
  out = {}
  for kind, u in layout.kinds().items():
    w = np.asarray(_widths(layout, widths)[kind], np.float64)
    bucket = lambda c: w[np.minimum(np.searchsorted(w, c), len(w) - 1)]
    active = np.asarray(u.active)
    pallas = runs_pallas(kernel, tuple(w), resize, offload)
    width = active.astype(np.float64) if pallas else bucket(active)
    executed = np.repeat(width[:, None], num_layers, axis=1)
    if offload is not None:
      rounds, chunk = offload_lib.static_shape(u)
      p = offload_lib.make_plan(u, offload.get(kind, {}), chunk=chunk, rounds=rounds)
      helped = (np.asarray(p.count) > 0).sum(1)
      executed = np.repeat((bucket(np.asarray(p.keep)) + chunk * helped)[:, None], num_layers,
                           axis=1)
    elif resize is not None:
      kept = np.asarray(resize.kept[kind])                               # [N, L]
      if resize.mode == "units":
        executed = np.where(kept < active[:, None], bucket(kept), executed)
      else:
        d_model = np.asarray(resize.feats[kind]).shape[-1]
        cut = (kept < active[:, None]) | (np.asarray(resize.feats_kept[kind]) < d_model)
        fraction = np.asarray(resize.fractions)[np.asarray(resize.frac[kind])]
        executed = np.where(cut, executed * fraction, executed)
    out[kind] = executed
  return out


def executes(executed: dict) -> np.ndarray:
  """bool [..., N]: whether each device executes some width in some block of `executed`
  ({kind: [..., N, L]} widths, `executed_widths`); a device that executes none is drained."""
  return np.any([np.asarray(e).max(axis=-1) > 0 for e in executed.values()], axis=0)


def branch_plans(plan: Plan, mesh: jax.sharding.Mesh) -> list[Plan]:
  """Plans under which every device takes each branch of `plan`'s compiled step once.

  XLA:CPU pays a one-time cost (about 0.2 s here) the first time a branch of a compiled step
  runs; a warm-up that runs these plans pays it instead of the first timed step after a change.
  Their results are meaningless (actives need not sum to the units): run them on a throwaway
  state. Covers the exact branches at every width and, for a units-mode resize, the resized ones.
  """
  put = lambda x: mesh_lib.put(x, mesh, P(mesh_lib.TENSOR))
  n = len(next(iter(plan.active.values())))
  widths = dict(plan.widths)
  full = lambda w: put(np.full(n, w, np.int32))
  out = []
  for i in range(max(len(w) for w in widths.values())):
    at = {k: w[min(i, len(w) - 1)] for k, w in widths.items()}
    active = {k: full(at[k]) for k in widths}
    if plan.resize is None:
      out.append(dataclasses.replace(plan, active=active))
      continue
    r = plan.resize
    kept = {k: put(np.full(r.kept[k].shape, at[k], np.int32)) for k in widths}
    out.append(dataclasses.replace(plan, active=active, resize=dataclasses.replace(r, kept=kept)))
    if r.mode == "units" and any(at[k] < widths[k][-1] for k in widths):
      cap = {k: full(w[-1]) for k, w in widths.items()}     # kept < active: resized branch
      out.append(dataclasses.replace(plan, active=cap, resize=dataclasses.replace(r, kept=kept)))
  return out


def _offload_plans(layout: layout_lib.Layout, mesh, offload: dict) -> dict:
  """{kind: placed OffloadPlan} with amount-independent statics, for every kind of `layout`."""
  kinds = layout.kinds()
  if not isinstance(offload, dict) or set(offload) - set(kinds):
    raise ValueError(f"offload: expected {{kind: {{straggler: {{helper: units}}}}}} with kinds "
                     f"in {sorted(kinds)}, got {offload!r}")
  out = {}
  for kind, u in kinds.items():
    rounds, chunk = offload_lib.static_shape(u)
    out[kind] = offload_lib.make_plan(u, offload.get(kind, {}), mesh, chunk=chunk,
                                      rounds=rounds)
  return out


def plan_specs(plan: Plan) -> Plan:
  """shard_map in_specs for a plan: every data leaf is split over `tensor`."""
  return jax.tree.map(lambda _: P(mesh_lib.TENSOR), plan)
