"""Priority scores over a run (`priority.Resizer`): refreshes, selections and exact periods."""

import jax
import numpy as np
from flax import nnx

import helpers as H
from semijax.balance import priority as priority_lib
from semijax.balance import resize as resize_spec_lib
from semijax.core import sharding
from semijax.models import gpt

N = 4


def model_params(seed):
  """Logical parameters of the test GPT (random, host numpy) and their axes; no engine."""
  abstract = nnx.eval_shape(lambda: gpt.GPT(rngs=nnx.Rngs(0), **H.GPT_KW))
  state = nnx.split(abstract)[1]
  axes = sharding.axes_tree(state)
  shapes = nnx.to_pure_dict(jax.tree.map(lambda v: v.shape, state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))
  rng = np.random.default_rng(seed)
  params = jax.tree.map(lambda s: rng.standard_normal(s).astype(np.float32), shapes,
                        is_leaf=lambda x: isinstance(x, tuple))
  return params, axes


def make_resizer(refresh_every=4):
  spec = resize_spec_lib.ResizeSpec(priority="weight_delta").validate(N)
  kw = H.GPT_KW
  priority = priority_lib.Priority(
      spec, num_layers=kw["num_layers"], d_model=kw["d_model"],
      num_units={"mlp": kw["d_ff"], "heads": kw["num_heads"]},
      unit_sizes={"mlp": 1, "heads": kw["d_model"] // kw["num_heads"]}, num_devices=N)
  return priority_lib.Resizer(priority, refresh_every)


def test_weight_changes_of_exact_periods_count_at_the_next_refresh():
  # Refresh, a period of exact steps (no unit resized), refresh again: every unit was computed
  # and changed, so every score is the L1 change of its weights. (Before, only units that a
  # resized step kept were marked, and exact periods left the scores at their initial 1.0.)
  r = make_resizer()
  layout = H.even_layout(N)
  p0, axes = model_params(0)
  assert r.due(0)
  r.refresh(0, p0, axes, layout)
  for _ in range(4):
    assert r.resize(layout, None) is None              # exact steps
  p1, _ = model_params(1)
  assert r.due(4) and not r.due(5)
  r.refresh(4, p1, axes, layout)
  w0, w1 = (priority_lib.unit_weights(p, axes, H.GPT_KW["num_layers"]) for p in (p0, p1))
  delta = {k: {role: w1[k][role] - w0[k][role] for role in w1[k]} for k in w1}
  np.testing.assert_allclose(r.priority.scores["mlp"], priority_lib.unit_l1(delta["mlp"], 1),
                             rtol=1e-5)
  assert not np.any(r.priority.scores["heads"] == 1.0)


def test_skipped_units_keep_their_stale_scores_and_selections_are_cached():
  r = make_resizer()
  layout = H.even_layout(N)
  p0, axes = model_params(0)
  r.refresh(0, p0, axes, layout)
  keep = (0.5, 1.0, 1.0, 1.0)
  first = r.resize(layout, keep)
  assert r.resize(layout, keep) is first and r.version == 1      # cached until a refresh
  skipped = [u for u, s in zip(layout.mlp.owned[0], first.skip["mlp"][0, 0]) if s]
  assert len(skipped) == H.GPT_KW["d_ff"] // N // 2
  p1, _ = model_params(1)
  r.refresh(4, p1, axes, layout)
  # Device 0's skipped units kept their stale scores; every computed unit got a new one.
  np.testing.assert_array_equal(r.priority.scores["mlp"][0, skipped], 1.0)
  computed = [u for u in range(H.GPT_KW["d_ff"]) if u not in skipped]
  assert np.all(r.priority.scores["mlp"][0, computed] != 1.0)
  assert r.resize(layout, keep) is not first and r.version == 2
