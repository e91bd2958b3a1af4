"""ZERO-resizing: resized blocks against a dense equivalent, imputation, freezing, priorities.

The dense equivalent of a resized step is built here independently of the engine: a resized
device's skipped units (units mode) or skipped input features and row units (contraction mode)
are zeroed in the *logical* weights, kept ones scaled for "rescale", and the standard Flax
reference model runs on one device; "fill" then writes its constant into the skipped entries of
the reference gradient.
"""

import os

import jax
import numpy as np
import pytest

import helpers as H
import helpers as train_test
from semijax.balance import priority as priority_lib
from semijax.balance import resize as resize_spec_lib
from semijax.core import engine as engine_lib
from semijax.core import layout as L
from semijax.core import resize as resize_lib
from semijax.core import sharding
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics

KEEP = (0.5, 1.0, 0.5, 0.25)
D_MODEL = H.GPT_KW["d_model"]
# The "fill" constant of these tests: not the default, so that a step which ignores the setting
# is seen; as small as the authors' so that an unfrozen step still moves skipped weights through
# their Adam moments, not through the fill.
FILL = 3e-12
ADAM_B1 = 0.9                 # optax.adamw's default (helpers.make_engine)


def uneven_layout(seed):
  """4 tensor devices: random uneven MLP units; heads (3, 1, 2, 2), non-contiguous, capacity 4.

  Two compute widths per kind keep the resized programs (2 variants per width) quick to compile.
  """
  heads = L.UnitLayout("heads", 8, ((5, 0, 7), (3,), (1, 6), (2, 4)), 4, (3, 1, 2, 2), (2, 4))
  mlp = H.random_layout(seed, 4).mlp
  return L.Layout(mlp=mlp.replace(widths=L.default_widths(mlp.capacity, 2)), heads=heads)


def make_priority(eng, layout, **spec):
  spec = resize_spec_lib.ResizeSpec(fractions=(0.5, 1.0), **spec).validate(layout.num_devices)
  return priority_lib.Priority(spec, num_layers=H.GPT_KW["num_layers"], d_model=D_MODEL,
                               num_units=eng.num_units, unit_sizes=eng.unit_sizes,
                               num_devices=layout.num_devices)


def dense_equivalent(eng, layout, rz, params):
  """(logical params of the dense model the resized step computes, skipped-entry masks)."""
  out, masks = {}, {}
  flat = jax.tree_util.tree_leaves_with_path(eng.axes)
  new_leaves, mask_leaves = [], []
  for (path, a), x in zip(flat, jax.tree.leaves(params)):
    x = np.array(x)
    mask = np.zeros(x.shape, bool)
    role, layer = resize_lib.role(a), sharding.block_index(path)
    if role is not None and layer is not None:
      axis, kind = a.unit()
      us, u = eng.unit_sizes[kind], layout.kinds()[kind]
      xm = np.moveaxis(x, axis, -1)          # unit axis last: col [D, U*us], row [D, U*us]
      mm = np.moveaxis(mask, axis, -1)
      for d in range(layout.num_devices):
        active = u.active[d]
        units = np.asarray(u.owned[d][:active])
        kept = rz.kept[kind][d, layer]
        kept_slots = rz.order[kind][d, layer, :kept]
        skipped = units[np.setdiff1d(np.arange(active), kept_slots)]
        cols = lambda us_: np.concatenate([np.arange(v * us, (v + 1) * us) for v in us_]
                                          ) if len(us_) else np.zeros(0, int)
        row_scale = active / kept if rz.rescale else 1.0
        if rz.mode == "units":
          mm[..., cols(skipped)] = True
          if role == "row":
            xm[..., cols(units)] *= row_scale
        elif role == "row":
          mm[..., cols(skipped)] = True
          xm[..., cols(units)] *= row_scale
        elif role == "col":
          feats = rz.feat_skip[kind][d, layer]
          idx = np.ix_(feats, cols(units))
          mm[idx] = True
          if rz.rescale:
            xm[..., cols(units)] *= D_MODEL / rz.feats_kept[kind][d, layer]
      xm[mm] = 0.0
    new_leaves.append(x)
    mask_leaves.append(mask)
  treedef = jax.tree.structure(params)
  return jax.tree.unflatten(treedef, new_leaves), jax.tree.unflatten(treedef, mask_leaves)


def logical_params(eng, tree, layout):
  """A padded parameter-shaped tree of `layout` in logical form, as numpy leaves."""
  tree = jax.tree.map(jax.device_put, tree, eng.param_shardings)
  out = eng.to_logical(engine_lib.TrainState(tree, eng.tx.init(tree)), layout).params
  return [np.asarray(x) for x in jax.tree.leaves(out)]


@pytest.mark.parametrize("mode,imputation", [("units", "zero"), ("units", "rescale"),
                                             ("units", "fill"),
                                             ("contraction", "zero"), ("contraction", "rescale")])
def test_resized_step_matches_dense_equivalent(mode, imputation):
  """Logits, gradients and skipped entries of a resized step match the dense equivalent's.

  "fill" acts only in the train step, on the gradient it applies: one unfrozen step from zero
  Adam moments leaves mu = (1 - b1) x that gradient, which must be the reference gradient with
  `FILL` in every skipped entry. The skip masks, where fill writes and freeze holds, are checked
  against the independent ones in both modes.
  """
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(7)
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, layout)
  pr = make_priority(eng, layout, keep=KEEP, mode=mode, imputation=imputation,
                     priority="random", fill_value=FILL, freeze=imputation != "fill")
  rz = pr.select(layout, KEEP)
  assert rz.skip["mlp"].sum() > 4 and rz.skip["heads"].sum() == 2 * (1 + 1 + 1)
  batch_np = H.make_batch("gpt", 3)
  plan = eng.plan(layout, resize=rz)
  logits, grads = H.logits_and_grads(eng, state.params, eng.shard_batch(batch_np), plan)
  dense, skipped = dense_equivalent(eng, layout, rz, logical.params)
  skipped = jax.tree.leaves(skipped)
  ref_logits, ref_grads = H.reference_logits_and_grads("gpt", dense, batch_np)
  ref_grads = [np.asarray(r) for r in jax.tree.leaves(ref_grads)]
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=3e-5, rtol=1e-5)
  exact_logits = eng.logits(state.params, eng.shard_batch(batch_np), eng.plan(layout))
  assert np.abs(np.asarray(exact_logits) - np.asarray(logits)).max() > 1e-3   # it did resize
  masks = padded_masks(eng, state.params, plan)
  for got, want in zip(logical_params(eng, jax.tree.map(np.float32, masks), layout), skipped):
    np.testing.assert_array_equal(got == 1, want)
  if imputation == "zero":
    for g, r, m in zip(logical_params(eng, grads, layout), ref_grads, skipped):
      assert np.all(g[m] == 0)
      np.testing.assert_allclose(g[~m], r[~m], atol=3e-5, rtol=1e-5)
  if imputation == "fill":
    state, _ = eng.train_step(state, eng.shard_batch(batch_np), plan)
    mu = param_moments(eng, eng.to_logical(state, layout).opt_state)[:len(skipped)]
    for g, r, m in zip(mu, ref_grads, skipped):
      g = g / (1 - ADAM_B1)
      np.testing.assert_allclose(g[m], FILL, rtol=1e-5, atol=0)
      np.testing.assert_allclose(g[~m], r[~m], atol=3e-5, rtol=1e-5)


def train_steps(eng, state, layout, plans, batches):
  losses = []
  for plan, b in zip(plans, batches):
    state, m = eng.train_step(state, b, plan)
    losses.append(float(m["loss"]))
  return state, losses


@pytest.mark.parametrize("mode", resize_lib.MODES)
def test_keep_one_is_bit_identical_to_no_resizing(mode):
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(3)
  batches = [eng.shard_batch(H.make_batch("gpt", s)) for s in range(3)]
  pr = make_priority(eng, layout, keep=(1.0,) * 4, mode=mode, imputation="fill",
                     freeze=True)
  resized = eng.plan(layout, resize=pr.select(layout, (1.0,) * 4))
  a, la = train_steps(eng, eng.init(0, layout), layout, [eng.plan(layout)] * 3, batches)
  b, lb = train_steps(eng, eng.init(0, layout), layout, [resized] * 3, batches)
  assert la == lb
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert np.array_equal(np.asarray(x), np.asarray(y))


def padded_masks(eng, params, plan):
  """The skip masks of `plan`, broadcast to the shapes of the padded `params`."""
  masks = jax.jit(lambda p: resize_lib.skip_masks(p.resize, p.active, eng.axes, eng.unit_sizes))(
      plan)
  shapes = jax.tree.map(lambda x: np.zeros(x.shape, bool), params)
  return jax.tree.map(lambda m, z: np.broadcast_to(np.asarray(m), z.shape), masks, shapes)


def param_moments(eng, opt_state):
  """Every parameter-shaped optimizer leaf (mu, then nu, each in parameter order), as numpy."""
  out = []
  sharding.map_params(eng.tx, lambda x, a: out.append(np.asarray(x)) or x, opt_state, eng.axes)
  return out


@pytest.mark.parametrize("mode", resize_lib.MODES)
def test_freeze_keeps_skipped_units_and_moments_unchanged(mode):
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(7)   # the dense test's: its unfrozen fill step is this program
  batches = [eng.shard_batch(H.make_batch("gpt", s)) for s in range(3)]
  state, _ = train_steps(eng, eng.init(0, layout), layout, [eng.plan(layout)] * 2, batches)
  before = jax.tree.map(np.asarray, state)
  after = {}
  for freeze in (True, False) if mode == "units" else (True,):
    pr = make_priority(eng, layout, keep=KEEP, mode=mode, imputation="fill", freeze=freeze,
                       fill_value=FILL)
    plan = eng.plan(layout, resize=pr.select(layout, KEEP))
    masks = padded_masks(eng, state.params, plan)
    start = eng.to_padded(eng.to_logical(state, layout), layout)   # a copy (steps donate)
    after[freeze], _ = train_steps(eng, start, layout, [plan], batches[2:])
  mask_leaves = jax.tree.leaves(masks)
  assert sum(m.sum() for m in mask_leaves) > 0
  for i, (m, x0, x1) in enumerate(zip(mask_leaves, jax.tree.leaves(before.params),
                                      jax.tree.leaves(after[True].params))):
    x1 = np.asarray(x1)
    assert np.array_equal(x1[m], x0[m])                 # frozen: not one bit changed
    assert np.any(x1[~m] != x0[~m])                     # the rest trained
    if m.any() and False in after:                      # unfrozen: Adam still moves them
      assert np.any(np.asarray(jax.tree.leaves(after[False].params)[i])[m] != x0[m])
  old, new = param_moments(eng, before.opt_state), param_moments(eng, after[True].opt_state)
  assert len(old) == 2 * len(mask_leaves)               # mu and nu
  for a, b, m in zip(old, new, mask_leaves * 2):
    assert np.array_equal(a[m], b[m]) and np.any(a[~m] != b[~m])


# --- priority policies, hand-built cases ----------------------------------------------------------

def test_pick_follows_each_policy():
  s = np.array([0.1, 5.0, 0.2, 3.0, 3.0, 0.0])
  np.testing.assert_array_equal(priority_lib.pick("weight_delta", s, 3), [1, 3, 4])
  np.testing.assert_array_equal(priority_lib.pick("magnitude", s, 2), [1, 3])  # tie: lower slot
  np.testing.assert_array_equal(priority_lib.pick("random", s, 6), np.arange(6))
  # window of 3: sums 5.3, 8.2, 6.2, 6.0 -> slots 1..3
  np.testing.assert_array_equal(priority_lib.pick("window", s, 3), [1, 2, 3])
  np.testing.assert_array_equal(priority_lib.pick("window", np.ones(5), 2), [0, 1])


def _edit(params, layer, name, fn):
  """A copy of logical `params` with blocks[layer].mlp[name] replaced by fn(old)."""
  params = jax.tree.map(np.array, params)
  block = params["encoder"]["blocks"][layer]["mlp"]
  block[name] = fn(block[name])
  return params


def on_devices(eng, params, layout):
  """Host logical `params` padded in `layout` on the devices (what a refresh reduces)."""
  logical = jax.tree.map(jax.device_put, params, eng.logical_shardings().params)
  return eng.to_padded(logical, layout)


def _owned_mlp(layout, d):
  return np.asarray(layout.mlp.owned[d])


@pytest.mark.parametrize("policy", ["weight_delta", "window"])
def test_weight_delta_scores_changes_and_keeps_stale_scores(policy):
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(11)
  params = jax.device_get(eng.init_logical(0).params)
  pr = make_priority(eng, layout, keep=KEEP, priority=policy)
  pr.refresh(on_devices(eng, params, layout), eng.axes, layout)   # first: a snapshot only
  assert np.all(pr.scores["mlp"] == 1.0)
  rz = pr.select(layout, KEEP)                            # ties: device 0 keeps its first half
  units = _owned_mlp(layout, 0)
  k = rz.kept["mlp"][0, 0]
  np.testing.assert_array_equal(rz.order["mlp"][0, 0, :k], np.arange(k))
  kept_units, skipped_units = units[:k], units[k:]
  # Change every unit of layer 0: by 0.01 per w1 entry, 10.0 for one skipped unit.
  big = skipped_units[0]
  def bump(w):
    w = w + 0.01
    w[:, big] += 10.0
    return w
  pr.refresh(on_devices(eng, _edit(params, 0, "w1", bump), layout), eng.axes, layout)
  scores = pr.scores["mlp"][0]
  np.testing.assert_allclose(scores[kept_units], 0.01 * D_MODEL, rtol=1e-4)  # L1 change
  assert np.all(scores[skipped_units] == 1.0)             # skipped: stale, not 10 * D_MODEL
  # Units computed on other devices got their deltas too; layer 1 did not change at all.
  assert np.all(pr.scores["mlp"][1][np.concatenate([kept_units, _owned_mlp(layout, 1)])] == 0)
  # Now the stale 1.0 scores beat 0.32: device 0 keeps its previously skipped units first.
  rz = pr.select(layout, KEEP)
  chosen = units[rz.order["mlp"][0, 0, :k]]
  if policy == "weight_delta":
    assert set(chosen) == set(skipped_units[:k])
  else:                                                   # the best contiguous window
    slot_scores = scores[units]
    sums = [slot_scores[i:i + k].sum() for i in range(len(units) - k + 1)]
    start = int(np.argmax(sums))
    np.testing.assert_array_equal(rz.order["mlp"][0, 0, :k], np.arange(start, start + k))


def test_magnitude_keeps_the_largest_units():
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(12)
  params = jax.device_get(eng.init_logical(0).params)
  units = _owned_mlp(layout, 2)
  big = units[-3:]
  params = _edit(params, 1, "w2", lambda w: w.__setitem__(big, 5.0) or w)
  pr = make_priority(eng, layout, keep=(1.0, 1.0, 3 / len(units), 1.0), priority="magnitude")
  pr.refresh(on_devices(eng, params, layout), eng.axes, layout)
  rz = pr.select(layout, pr.spec.keep)
  assert rz.kept["mlp"][2, 1] == 3
  assert set(units[rz.order["mlp"][2, 1, :3]]) == set(big)
  assert not rz.skip["mlp"][[0, 1, 3]].any()               # devices with keep 1.0 skip nothing


def test_random_policy_is_seeded_and_redrawn_at_refresh():
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(13)
  params = jax.device_get(eng.init_logical(0).params)
  picks = []
  for _ in range(2):
    pr = make_priority(eng, layout, keep=KEEP, priority="random")
    first = pr.select(layout, KEEP).order["mlp"].copy()
    pr.refresh(on_devices(eng, params, layout), eng.axes, layout)
    picks.append((first, pr.select(layout, KEEP).order["mlp"]))
  np.testing.assert_array_equal(picks[0][0], picks[1][0])   # same seed, same subsets
  np.testing.assert_array_equal(picks[0][1], picks[1][1])
  assert not np.array_equal(picks[0][0], picks[0][1])       # a refresh draws new ones


def test_contraction_features_follow_their_scores():
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(14)
  params = jax.device_get(eng.init_logical(0).params)
  pr = make_priority(eng, layout, keep=(0.25, 1.0, 1.0, 1.0), mode="contraction",
                     priority="magnitude")
  units = _owned_mlp(layout, 0)
  rows = np.array([3, 17, 20, 30, 31, 8, 9, 1])            # 8 = 0.25 * d_model features
  def big_rows(w):
    w[np.ix_(rows, units)] = 3.0
    return w
  pr.refresh(on_devices(eng, _edit(params, 0, "w1", big_rows), layout), eng.axes, layout)
  rz = pr.select(layout, pr.spec.keep)
  assert rz.feats_kept["mlp"][0, 0] == 8
  np.testing.assert_array_equal(rz.feats["mlp"][0, 0, :8], np.sort(rows))
  np.testing.assert_array_equal(rz.feat_skip["mlp"][0, 0], ~np.isin(np.arange(D_MODEL), rows))
  assert rz.frac["mlp"][0, 0] == 0 and np.all(rz.frac["mlp"][1:] == 1)


# --- evaluation, schedule, config -----------------------------------------------------------------

def test_evaluation_never_resizes():
  eng = H.make_engine("gpt", 1, 4)
  layout = uneven_layout(4)
  state = eng.init(0, layout)
  batch = eng.shard_batch(H.make_batch("gpt", 1))
  pr = make_priority(eng, layout, keep=KEEP)
  resized = eng.plan(layout, resize=pr.select(layout, KEEP))
  exact = eng.plan(layout)
  a = jax.device_get(eng.eval_terms(state.params, batch, resized))
  b = jax.device_get(eng.eval_terms(state.params, batch, exact))
  assert a == b
  resized_loss = float(jax.jit(eng.loss)(state.params, batch, resized)[0])
  assert abs(resized_loss - float(a["loss_sum"] / a["count"])) > 1e-4


def test_rotating_straggler_schedule():
  spec = resize_spec_lib.ResizeSpec(straggler="rotate", straggler_keep=0.5).validate(4)
  got = [spec.keep_ratios(step, 4, epoch_steps=3) for step in range(13)]
  stragglers = [r.index(0.5) for r in got]
  assert stragglers == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 0]
  assert all(sorted(r) == [0.5, 1.0, 1.0, 1.0] for r in got)
  fixed = resize_spec_lib.ResizeSpec(straggler=(1, 3), straggler_keep=0.25).validate(4)
  assert fixed.keep_ratios(7, 4, 3) == (1.0, 0.25, 1.0, 0.25)


@pytest.mark.parametrize("field,value,message", [
    ("priority", "largest", "config.resize.priority: 'largest' is not one of"),
    ("imputation", "mean", "config.resize.imputation: 'mean' is not one of"),
    ("mode", "rows", "config.resize.mode: 'rows' is not one of"),
    ("keep", (1.0, 0.0, 1.0, 1.0), "config.resize.keep: every ratio must be in (0, 1], got 0.0"),
    ("keep", (1.0, 1.5, 1.0, 1.0), "config.resize.keep: every ratio must be in (0, 1], got 1.5"),
    ("keep", (0.5, 1.0), "config.resize.keep: 2 ratios (0.5, 1.0) for mesh.tensor = 4"),
    ("straggler_keep", 0.0, "config.resize.straggler_keep: must be in (0, 1]"),
    ("straggler", "slowest", "config.resize.straggler: 'slowest' is not 'rotate'"),
    ("straggler", (4,), "config.resize.straggler: device 4 is not in [0, 4)"),
    ("fractions", (0.5, 0.9), "config.resize.fractions: (0.5, 0.9) must be"),
])
def test_bad_resize_settings_are_refused(field, value, message):
  config = train_test.tiny_gpt(tensor=4)
  config.resize[field] = value
  with pytest.raises(config_lib.ConfigError) as e:
    config_lib.validate(config, 8)
  assert message in str(e.value)


def test_resize_settings_from_strings():
  config = train_test.tiny_gpt(tensor=4)
  config.resize.straggler = "1,3"
  assert config_lib.validate(config, 8).resize.straggler == (1, 3)
  config.resize.straggler = 3
  assert config_lib.validate(config, 8).resize.straggler == (3,)
  config.resize.straggler = ""
  assert not config_lib.validate(config, 8).resize.scheduled     # nobody resized


# --- training ---------------------------------------------------------------------------------

def resized_config(steps):
  config = train_test.tiny_gpt(tensor=4, steps=steps)
  config.model.num_layers = 2
  config.resize.straggler = "rotate"
  config.resize.epoch_steps = 2
  config.resize.refresh_every = 3
  config.resize.fractions = (0.5, 1.0)
  return config


def test_training_with_a_rotating_straggler_resumes_exactly(tmp_path):
  whole = train.train_and_evaluate(resized_config(6), str(tmp_path / "whole"))
  train.train_and_evaluate(resized_config(3), str(tmp_path / "split"))
  split = train.train_and_evaluate(resized_config(6), str(tmp_path / "split"))
  assert split["start_step"] == 3
  assert split["losses"] == whole["losses"][3:]            # priority state came back too
  records = metrics.read_jsonl(str(tmp_path / "whole" / "metrics.jsonl"))
  assert [r["resize/resized_devices"] for r in records] == [1] * 6
  assert {r["resize/min_keep"] for r in records} == {0.5}
