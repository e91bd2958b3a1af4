"""Priority scores over a run (`priority.Priority`, `priority.Resizer`): refreshes reduce the
weights on the devices; the scores they give per logical unit match a host computation on the
logical weights; exact periods mark their units as seen; snapshots move with the state."""

import jax
import numpy as np
from flax import nnx

import helpers as H
from semijax.balance import priority as priority_lib
from semijax.balance import resize as resize_spec_lib
from semijax.core import mesh as mesh_lib
from semijax.core import resize as resize_lib
from semijax.core import sharding
from semijax.models import gpt

N = 4
KW = H.GPT_KW
UNIT_SIZES = {"mlp": 1, "heads": KW["d_model"] // KW["num_heads"]}


def model_params(seed):
  """Logical parameters of the test GPT (random, host numpy) and their axes; no engine."""
  abstract = nnx.eval_shape(lambda: gpt.GPT(rngs=nnx.Rngs(0), **KW))
  state = nnx.split(abstract)[1]
  axes = sharding.axes_tree(state)
  shapes = nnx.to_pure_dict(jax.tree.map(lambda v: v.shape, state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  return params, axes


def padded(params, axes, layout):
  """`params` packed into `layout` and placed on a (1, N) mesh, unit axes split over tensor."""
  mesh = mesh_lib.make_mesh(1, N)
  tree = sharding.pack_tree(params, axes, sharding.slot_index(layout), UNIT_SIZES)
  return jax.tree.map(jax.device_put, tree, sharding.shardings(axes, mesh))


def host_unit_l1(params, reference, axes):
  """The reference: {kind: [L, U]} L1 of each logical unit's entries of `params - reference`."""
  out = {k: np.zeros((KW["num_layers"], n)) for k, n in (("mlp", KW["d_ff"]),
                                                           ("heads", KW["num_heads"]))}
  flat = jax.tree_util.tree_leaves_with_path(axes)
  for (path, a), x, r in zip(flat, jax.tree.leaves(params), jax.tree.leaves(reference)):
    if resize_lib.role(a) is None or (layer := sharding.block_index(path)) is None:
      continue
    axis, kind = a.unit()
    d = np.abs(np.asarray(x) - np.asarray(r))
    per_entry = d.sum(axis=tuple(i for i in range(d.ndim) if i != axis))
    out[kind][layer] += per_entry.reshape(-1, UNIT_SIZES[kind]).sum(-1)
  return out


def make_resizer(refresh_every=4):
  spec = resize_spec_lib.ResizeSpec(priority="weight_delta").validate(N)
  priority = priority_lib.Priority(
      spec, num_layers=KW["num_layers"], d_model=KW["d_model"],
      num_units={"mlp": KW["d_ff"], "heads": KW["num_heads"]}, unit_sizes=UNIT_SIZES,
      num_devices=N)
  return priority_lib.Resizer(priority, refresh_every)


def test_weight_changes_of_exact_periods_count_at_the_next_refresh():
  # Refresh, a period of exact steps (no unit resized), refresh again: every unit was computed
  # and changed, so every score is the L1 change of its weights (computed on the devices, in an
  # uneven layout, mapped back to logical units). Before, only units that a resized step kept
  # were marked, and exact periods left the scores at their initial 1.0.
  r = make_resizer()
  layout = H.random_layout(3, N)
  p0, axes = model_params(0)
  assert r.due(0)
  r.refresh(0, padded(p0, axes, layout), axes, layout)
  for _ in range(4):
    assert r.resize(layout, None) is None              # exact steps
  p1, _ = model_params(1)
  assert r.due(4) and not r.due(5)
  r.refresh(4, padded(p1, axes, layout), axes, layout)
  want = host_unit_l1(p1, p0, axes)
  for kind in ("mlp", "heads"):
    np.testing.assert_allclose(r.priority.scores[kind], want[kind], rtol=1e-5)


def test_skipped_units_keep_their_stale_scores_and_selections_are_cached():
  r = make_resizer()
  layout = H.even_layout(N)
  p0, axes = model_params(0)
  r.refresh(0, padded(p0, axes, layout), axes, layout)
  keep = (0.5, 1.0, 1.0, 1.0)
  first = r.resize(layout, keep)
  assert r.resize(layout, keep) is first and r.version == 1      # cached until a refresh
  skipped = [u for u, s in zip(layout.mlp.owned[0], first.skip["mlp"][0, 0]) if s]
  assert len(skipped) == KW["d_ff"] // N // 2
  p1, _ = model_params(1)
  r.refresh(4, padded(p1, axes, layout), axes, layout)
  # Device 0's skipped units kept their stale scores; every computed unit got a new one.
  np.testing.assert_array_equal(r.priority.scores["mlp"][0, skipped], 1.0)
  computed = [u for u in range(KW["d_ff"]) if u not in skipped]
  assert np.all(r.priority.scores["mlp"][0, computed] != 1.0)
  assert r.resize(layout, keep) is not first and r.version == 2


def test_snapshot_is_a_device_copy_that_moves_with_the_layout():
  r = make_resizer()
  a, b = H.even_layout(N), H.random_layout(5, N)
  p0, axes = model_params(0)
  r.refresh(0, padded(p0, axes, a), axes, a)
  snap = r.priority.snapshot
  assert all(isinstance(x, jax.Array) for x in jax.tree.leaves(snap))
  assert jax.tree.leaves(snap)[0].sharding == jax.tree.leaves(padded(p0, axes, a))[0].sharding
  # What a migration does to it (here: a re-pack on the host, standing in for the collective).
  r.priority.move_snapshot(lambda t: padded(p0, axes, b))
  p1, _ = model_params(1)
  r.resize(b, None)
  r.refresh(4, padded(p1, axes, b), axes, b)
  np.testing.assert_allclose(r.priority.scores["mlp"], host_unit_l1(p1, p0, axes)["mlp"],
                             rtol=1e-5)
