"""Priority selection for ZERO-resizing: which units (or features) a resized device keeps.

Scores are kept on the host per *logical* unit (so they survive any layout change, and a
migration carries them for free) and, in contraction mode, per device and input feature. A
refresh reduces the weights on the devices (`slot_l1`: an L1 per padded slot and per device and
feature) and fetches only those sums; the weights of the last refresh (`snapshot`) stay on the
devices, padded in the current layout (a migration moves them with the state, `move_snapshot`).
Policies (`PRIORITIES`):

  weight_delta  the authors': the L1 change of each unit's weights since the last refresh; only
                indices computed in the period get a new score, skipped ones keep their stale
                score (initially 1.0, ties go to the lower slot), and the top-scored are kept;
  window        the contiguous window (in slot / feature order) with the largest summed score
                (scores as weight_delta);
  random        a fresh random subset at every refresh (seeded);
  magnitude     the L1 norm of each unit's current weights.

`refresh(...)` recomputes scores every `refresh_every` steps (default one epoch); `select(...)`
turns scores and keep ratios into a `resize.Resize`. `state_dict()` goes into checkpoints.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from semijax.core import layout as layout_lib
from semijax.core import memory
from semijax.core import resize as resize_lib
from semijax.core import sharding

PRIORITIES = ("weight_delta", "random", "window", "magnitude")
ROLES = ("col", "bias", "row")


def slot_l1(params, reference, axes, *, num_layers: int, num_devices: int, unit_sizes: dict,
            unit_roles=ROLES):
  """Per-slot and per-feature L1 norms of `params - reference`, reduced where the arrays live.

  Args:
    params: padded parameters (global arrays, unit axes split over `tensor`).
    reference: a tree like `params` (the last snapshot), or None for `params` themselves.
    axes: the `sharding.Axes` tree; num_layers: L; num_devices: N; unit_sizes: {kind: us}.
    unit_roles: the roles ("col", "bias", "row": `core.resize.role`) a unit's score sums over.

  Returns:
    ({kind: float32 [L, N*C]}: each padded slot's L1 over its entries in `unit_roles` (zero on
    padding), {kind: float32 [L, N, D]}: per device and input feature, the L1 of its column
    weights over its slots). Both are small; nothing of the size of the weights leaves the
    devices.
  """
  units, feats = {}, {}
  refs = jax.tree.leaves(params) if reference is None else jax.tree.leaves(reference)
  for (path, a), x, r in zip(jax.tree_util.tree_leaves_with_path(axes), jax.tree.leaves(params),
                             refs):
    role, layer = resize_lib.role(a), sharding.block_index(path)
    if role is None or layer is None:
      continue
    axis, kind = a.unit()
    d = jnp.abs(x - r) if reference is not None else jnp.abs(x)
    slots = x.shape[axis] // unit_sizes[kind]
    units.setdefault(kind, [jnp.zeros(slots, jnp.float32)] * num_layers)
    if role in unit_roles:
      per_entry = d.sum(axis=tuple(i for i in range(d.ndim) if i != axis))     # [N*C*us]
      units[kind][layer] = units[kind][layer] + per_entry.reshape(slots, -1).sum(-1)
    if role == "col":                                                         # [D, N*C*us]
      per_device = d.reshape(d.shape[0], num_devices, -1).sum(-1).T           # [N, D]
      feats.setdefault(kind, [0.0] * num_layers)
      feats[kind][layer] = feats[kind][layer] + per_device
  return ({k: jnp.stack(v) for k, v in units.items()},
          {k: jnp.stack(v) for k, v in feats.items()})


def pick(policy: str, scores: np.ndarray, k: int) -> np.ndarray:
  """Sorted indices of the `k` entries of `scores` to keep under `policy`."""
  n = len(scores)
  if k >= n:
    return np.arange(n)
  if policy == "window":
    sums = np.convolve(scores, np.ones(k), mode="valid")                    # [n - k + 1]
    start = int(np.argmax(sums))                                            # first best window
    return np.arange(start, start + k)
  return np.sort(np.argsort(-scores, kind="stable")[:k])


class Priority:
  """Scores and selection of the units each resized device keeps (see module doc).

  Args:
    spec: the `balance.resize.ResizeSpec` (mode, priority, seed-independent settings).
    num_layers, d_model: model sizes; num_units: {kind: U}; unit_sizes: {kind: entries per unit}.
    num_devices: N, devices on the tensor axis.
    seed: for the random policy.
    compiled: where the compiled score reductions are kept (e.g. the engine's
      `helper_programs`, shared by runs that reuse it); default a dict of this priority's own.
  """

  def __init__(self, spec, *, num_layers: int, d_model: int,
               num_units: dict, unit_sizes: dict, num_devices: int, seed: int = 0,
               compiled: dict | None = None):
    self.spec, self.num_layers, self.d_model = spec, num_layers, d_model
    self.num_units, self.unit_sizes, self.num_devices, self.seed = (
        dict(num_units), dict(unit_sizes), num_devices, seed)
    self.refreshes = 0
    self.snapshot = None       # padded device params of the last refresh (weight_delta, window)
    self._compiled = {} if compiled is None else compiled
    self.scores = {k: self._initial((num_layers, u), 0) for k, u in self.num_units.items()}
    self.feat_scores = {k: self._initial((num_layers, num_devices, d_model), 1)
                        for k in self.num_units}
    self._clear_seen()

  def _initial(self, shape, salt):
    if self.spec.priority == "random":
      return np.random.default_rng([self.seed, 0, salt]).random(shape)
    return np.ones(shape)

  def _clear_seen(self):
    self.seen = {k: np.zeros(s.shape, bool) for k, s in self.scores.items()}
    self.feat_seen = {k: np.zeros(s.shape, bool) for k, s in self.feat_scores.items()}

  # --- scores -----------------------------------------------------------------------------------

  def refresh(self, params, axes, layout: layout_lib.Layout) -> None:
    """Recomputes scores from padded device `params` in `layout` (see module doc); starts a new
    period and keeps a device copy of `params` as the next period's snapshot."""
    policy, contraction = self.spec.priority, self.spec.mode == "contraction"
    if policy == "random":
      for kind in self.unit_sizes:
        rng = np.random.default_rng([self.seed, self.refreshes + 1])
        self.scores[kind] = rng.random(self.scores[kind].shape)
        self.feat_scores[kind] = rng.random(self.feat_scores[kind].shape)
    elif policy == "magnitude" or self.snapshot is not None:
      reference = None if policy == "magnitude" else self.snapshot
      fn = self._scores_fn(axes, contraction, params, reference)
      memory.observe(fn)
      slots, feats = jax.device_get(fn(params, reference))
      for kind, u in layout.kinds().items():
        new = slots[kind][:, u.unit_slots()]                          # [L, U]: slot -> unit
        if policy == "magnitude":
          self.scores[kind], self.feat_scores[kind] = new, feats[kind]
        else:            # weight_delta, window: change since the last refresh, where computed
          self.scores[kind] = np.where(self.seen[kind], new, self.scores[kind])
          self.feat_scores[kind] = np.where(self.feat_seen[kind], feats[kind],
                                            self.feat_scores[kind])
    if policy in ("weight_delta", "window"):
      self.snapshot = jax.tree.map(lambda x: x.copy(), params)
    self.refreshes += 1
    self._clear_seen()

  def warm_up(self, params, axes) -> None:
    """Compiles the refresh's reduction for `params`' shapes (with and without a snapshot)."""
    contraction = self.spec.mode == "contraction"
    self._scores_fn(axes, contraction, params, None)
    self._scores_fn(axes, contraction, params, params)

  def _scores_fn(self, axes, contraction: bool, params, reference):
    """The compiled `slot_l1` for these shapes (one per bucket, with and without a snapshot)."""
    key = ("priority_scores", id(axes), contraction, reference is None, self.num_layers,
           self.num_devices, tuple(sorted(self.unit_sizes.items())),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(params)))
    if key not in self._compiled:
      roles = ("row",) if contraction else ROLES
      fn = jax.jit(functools.partial(
          slot_l1, axes=axes, num_layers=self.num_layers, num_devices=self.num_devices,
          unit_sizes=self.unit_sizes, unit_roles=roles))
      self._compiled[key] = fn.lower(params, reference).compile()
    return self._compiled[key]

  def move_snapshot(self, move) -> None:
    """Applies `move` (padded params -> padded params in another layout) to the snapshot."""
    if self.snapshot is not None:
      self.snapshot = move(self.snapshot)

  def mark_computed(self, layout: layout_lib.Layout) -> None:
    """Marks every unit (and, in contraction mode, every input feature) that an exact step of
    `layout` computes as seen in this period: its weights change, so the next refresh must score
    it anew. (`select` marks what a resized step keeps.)"""
    for kind, u in layout.kinds().items():
      for d, owned in enumerate(u.owned):
        self.seen[kind][:, list(owned[:u.active[d]])] = True
        if u.active[d]:
          self.feat_seen[kind][:, d] = True

  # --- selection --------------------------------------------------------------------------------

  def select(self, layout: layout_lib.Layout, keep, *, mark: bool = True) -> resize_lib.Resize:
    """The `Resize` (host numpy) for per-device keep ratios `keep` [N]; marks the kept as seen
    (unless `mark` is False: a preview, e.g. to compile the resized step)."""
    spec, L, D = self.spec, self.num_layers, self.d_model
    contraction = spec.mode == "contraction"
    out = {f: {} for f in ("order", "kept", "skip", "feats", "feats_kept", "feat_skip", "frac")}
    for kind, u in layout.kinds().items():
      n, c = u.num_devices, u.capacity
      order = np.tile(np.arange(c, dtype=np.int32), (n, L, 1))
      kept = np.zeros((n, L), np.int32)
      skip = np.zeros((n, L, c), bool)
      feats = np.tile(np.arange(D, dtype=np.int32), (n, L, 1))
      feats_kept = np.full((n, L), D, np.int32)
      feat_skip = np.zeros((n, L, D), bool)
      frac = np.zeros((n, L), np.int32)
      for d in range(n):
        active = u.active[d]
        units = np.asarray(u.owned[d][:active], np.int64)
        k = resize_lib.kept_count(keep[d], active)
        kf = resize_lib.kept_count(keep[d], D) if contraction else D
        for l in range(L):
          chosen = pick(spec.priority, self.scores[kind][l, units], k)
          rest = np.setdiff1d(np.arange(active), chosen)
          order[d, l, :active] = np.concatenate([chosen, rest])
          kept[d, l] = k
          skip[d, l, rest] = True
          if mark:
            self.seen[kind][l, units[chosen]] = True
          if contraction:
            fc = pick(spec.priority, self.feat_scores[kind][l, d], kf)
            feats[d, l] = np.concatenate([fc, np.setdiff1d(np.arange(D), fc)])
            feats_kept[d, l] = kf
            feat_skip[d, l] = True
            feat_skip[d, l, fc] = False
            if mark:
              self.feat_seen[kind][l, d, fc] = True
            frac[d, l] = resize_lib.fraction_index(keep[d], spec.fractions)
      out["order"][kind], out["kept"][kind], out["skip"][kind] = order, kept, skip
      if contraction:
        out["feats"][kind], out["feats_kept"][kind] = feats, feats_kept
        out["feat_skip"][kind], out["frac"][kind] = feat_skip, frac
    return resize_lib.Resize(**out, mode=spec.mode, imputation=spec.imputation,
                             fill_value=float(spec.fill_value), freeze=bool(spec.freeze),
                             fractions=tuple(float(f) for f in spec.fractions))

  # --- checkpoints ------------------------------------------------------------------------------

  def state_dict(self) -> dict:
    """Layout-independent host state for checkpoints (numpy arrays; the device snapshot is
    checkpointed with the train state, in logical form)."""
    return {"refreshes": np.asarray(self.refreshes), "scores": self.scores,
            "feat_scores": self.feat_scores, "seen": self.seen, "feat_seen": self.feat_seen}

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()` output; per-device feature scores reset if N changed."""
    self.refreshes = int(state["refreshes"])
    self.scores = {k: np.asarray(v) for k, v in state["scores"].items()}
    self.seen = {k: np.asarray(v, bool) for k, v in state["seen"].items()}
    fs = {k: np.asarray(v) for k, v in state["feat_scores"].items()}
    if all(v.shape == self.feat_scores[k].shape for k, v in fs.items()):
      self.feat_scores = fs
      self.feat_seen = {k: np.asarray(v, bool) for k, v in state["feat_seen"].items()}


class Resizer:
  """A run's priority over time: when scores refresh, and the `Resize` of each step.

  Scores are refreshed at every multiple of `refresh_every` steps (and at the first step if never
  refreshed), as in the authors' code. Between refreshes one `Resize` serves every step with the
  same keep ratios and layout (`version` counts new ones, so plans built from a `Resize` can be
  cached by it). A step without resizing computes every owned unit: those units are marked as
  seen, so that their weight changes count at the next refresh.

  Args:
    priority: the `Priority` (scores and selection).
    refresh_every: steps between refreshes.
  """

  def __init__(self, priority: Priority, refresh_every: int):
    self.priority, self.refresh_every = priority, max(int(refresh_every), 1)
    self.version = 0
    self._scores_step = None
    self._cache = (None, None)         # ((keep, layout), Resize) since the last refresh
    self._marked = None                # the layout whose exact steps are marked this period

  def due(self, step: int) -> bool:
    """Whether 0-based `step` refreshes the scores (once per step)."""
    return step != self._scores_step and (step % self.refresh_every == 0
                                           or self.priority.refreshes == 0)

  def refresh(self, step: int, params, axes, layout: layout_lib.Layout) -> None:
    """Recomputes the scores from logical host `params` at 0-based `step`."""
    self.priority.refresh(params, axes, layout)
    self._scores_step = step
    self._cache = (None, None)
    self._marked = None

  def resize(self, layout: layout_lib.Layout, keep) -> resize_lib.Resize | None:
    """The host `Resize` for keep ratios `keep` [N] in `layout`, or None (an exact step)."""
    if keep is None:
      if self._marked != layout:
        self.priority.mark_computed(layout)
        self._marked = layout
      return None
    cached, resize = self._cache
    if cached != (keep, layout):
      resize = self.priority.select(layout, keep)
      self._cache = ((keep, layout), resize)
      self.version += 1
    return resize

