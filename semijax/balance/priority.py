"""Priority selection for ZERO-resizing: which units (or features) a resized device keeps.

Runs on the host, between steps. Scores are kept per *logical* unit (so they survive any layout
change, and a migration carries them for free) and, in contraction mode, per device and input
feature. Policies (`PRIORITIES`):

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

import jax
import numpy as np

from semijax.core import layout as layout_lib
from semijax.core import resize as resize_lib

PRIORITIES = ("weight_delta", "random", "window", "magnitude")
ROLES = ("col", "bias", "row")


def unit_weights(params, axes, num_layers: int) -> dict:
  """Weights of the TP units, grouped: {kind: {role: float32 [L, n, ...]}} (host numpy).

  Args:
    params: logical parameters (unit axes in logical unit order).
    axes: the `sharding.Axes` tree.
    num_layers: L.

  Returns:
    role "col": [L, n, D, U*us] column-parallel weights; "bias": [L, n, U*us]; "row":
    [L, n, U*us, D] (n leaves of that role per layer, e.g. 3 for wq, wk, wv).
  """
  groups: dict = {}
  flat = jax.tree_util.tree_leaves_with_path(axes)
  values = jax.tree.leaves(params)
  for (path, a), x in zip(flat, values):
    r, layer = resize_lib.role(a), resize_lib.block_index(path)
    if r is None or layer is None:
      continue
    kind = a.unit()[1]
    groups.setdefault(kind, {}).setdefault(r, [[] for _ in range(num_layers)])[layer].append(
        np.asarray(x, np.float32))
  return {k: {r: np.stack([np.stack(per) for per in layers]) for r, layers in g.items()}
          for k, g in groups.items()}


def unit_l1(w: dict, unit_size: int, roles=ROLES) -> np.ndarray:
  """float [L, U]: the L1 norm of every unit's entries over `roles` of `unit_weights` output."""
  total = 0.0
  for r in roles:
    a = np.abs(w[r])
    per_entry = {"col": lambda: a.sum(axis=(1, 2)), "bias": lambda: a.sum(axis=1),
                 "row": lambda: a.sum(axis=(1, 3))}[r]()                   # [L, U*us]
    total = total + per_entry.reshape(a.shape[0], -1, unit_size).sum(-1)
  return total


def feature_l1(w: dict, unit_size: int, owned) -> np.ndarray:
  """float [L, N, D]: per device, the L1 of each input feature's column weights over its units."""
  a = np.abs(w["col"]).sum(axis=1)                                          # [L, D, U*us]
  per_unit = a.reshape(a.shape[0], a.shape[1], -1, unit_size).sum(-1)       # [L, D, U]
  return np.stack([per_unit[:, :, list(units)].sum(-1) for units in owned], axis=1)


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
  """

  def __init__(self, spec, *, num_layers: int, d_model: int,
               num_units: dict, unit_sizes: dict, num_devices: int, seed: int = 0):
    self.spec, self.num_layers, self.d_model = spec, num_layers, d_model
    self.num_units, self.unit_sizes, self.num_devices, self.seed = (
        dict(num_units), dict(unit_sizes), num_devices, seed)
    self.refreshes = 0
    self.snapshot = None
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
    """Recomputes scores from logical `params` (see module doc); starts a new period."""
    w = unit_weights(params, axes, self.num_layers)
    policy, contraction = self.spec.priority, self.spec.mode == "contraction"
    unit_roles = ("row",) if contraction else ROLES
    owned = {k: u.owned for k, u in layout.kinds().items()}
    for kind, us in self.unit_sizes.items():
      if policy == "random":
        rng = np.random.default_rng([self.seed, self.refreshes + 1])
        self.scores[kind] = rng.random(self.scores[kind].shape)
        self.feat_scores[kind] = rng.random(self.feat_scores[kind].shape)
      elif policy == "magnitude":
        self.scores[kind] = unit_l1(w[kind], us, unit_roles)
        self.feat_scores[kind] = feature_l1(w[kind], us, owned[kind])
      elif self.snapshot is not None:            # weight_delta, window: change since the last one
        delta = {r: w[kind][r] - self.snapshot[kind][r] for r in w[kind]}
        self.scores[kind] = np.where(self.seen[kind], unit_l1(delta, us, unit_roles),
                                     self.scores[kind])
        self.feat_scores[kind] = np.where(self.feat_seen[kind],
                                          feature_l1(delta, us, owned[kind]),
                                          self.feat_scores[kind])
    self.snapshot = w
    self.refreshes += 1
    self._clear_seen()

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

  def select(self, layout: layout_lib.Layout, keep) -> resize_lib.Resize:
    """The `Resize` (host numpy) for per-device keep ratios `keep` [N]; marks the kept as seen."""
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
          self.seen[kind][l, units[chosen]] = True
          if contraction:
            fc = pick(spec.priority, self.feat_scores[kind][l, d], kf)
            feats[d, l] = np.concatenate([fc, np.setdiff1d(np.arange(D), fc)])
            feats_kept[d, l] = kf
            feat_skip[d, l] = True
            feat_skip[d, l, fc] = False
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
    """Layout-independent state for checkpoints (numpy arrays)."""
    out = {"refreshes": np.asarray(self.refreshes), "scores": self.scores,
           "feat_scores": self.feat_scores, "seen": self.seen, "feat_seen": self.feat_seen}
    if self.snapshot is not None:
      out["snapshot"] = self.snapshot
    return out

  def load_state_dict(self, state: dict) -> None:
    """Restores `state_dict()` output; per-device feature scores reset if N changed."""
    self.refreshes = int(state["refreshes"])
    self.scores = {k: np.asarray(v) for k, v in state["scores"].items()}
    self.seen = {k: np.asarray(v, bool) for k, v in state["seen"].items()}
    fs = {k: np.asarray(v) for k, v in state["feat_scores"].items()}
    if all(v.shape == self.feat_scores[k].shape for k, v in fs.items()):
      self.feat_scores = fs
      self.feat_seen = {k: np.asarray(v, bool) for k, v in state["feat_seen"].items()}
    snap = state.get("snapshot")
    self.snapshot = None if snap is None else jax.tree.map(np.asarray, snap)


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

