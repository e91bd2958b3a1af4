"""The Llama model with uneven KV groups and MLP units against an independent dense reference.

  * logits and every gradient match `llama_reference` (plain jax.numpy from the math) in fp32
    for random uneven layouts on 8 fake devices, where devices own 0 KV groups or 0 MLP units,
    a device owns nothing at all (drained), for multi-query, grouped and multi-head attention,
    tied embeddings, a 2x4 data x tensor mesh and the pallas width kernel;
  * a ZERO-resized step (units and contraction modes) matches the reference on the dense
    equivalent (the skipped units or features zeroed), and an offloaded step the reference;
  * an uneven split trains like the even one, and a migration mid-run like the run without it;
  * the spec (and the planner's costs) count KV groups as the "heads" units, SwiGLU's three
    matrices and GQA's smaller K and V in FLOPs and parameters; bad fields are refused by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers as H
import llama_reference as ref
from semijax import models
from semijax.balance import priority as priority_lib
from semijax.balance import resize as resize_spec_lib
from semijax.core import engine as engine_lib
from semijax.core import flops
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import migrate
from semijax.core import offload
from semijax.core import precision as precision_lib
from semijax.core import resize as resize_lib
from semijax.core import sharding
from semijax.errors import ConfigError
from semijax.models import llama
from semijax.models import tasks
from semijax.planner import costs as planner_costs

KW = dict(vocab_size=64, seq_len=8, d_model=32, num_heads=8, num_kv_heads=4, d_ff=48,
          num_layers=2)
ATOL = 2e-5


def make_engine(data=1, tensor=8, tx=None, kernel="auto", **kw):
  kw = dict(KW, **kw)
  return engine_lib.Engine(lambda rngs: llama.Llama(rngs=rngs, **kw), tasks.language_model,
                           mesh_lib.make_mesh(data, tensor), tx or optax.adamw(1e-2),
                           kernel=kernel)


def random_units(rng, kind, num_units, n, zeros):
  """Random non-contiguous ownership; devices in `zeros` own nothing, the others at least one
  unit when there are enough; capacity one above the largest count, with the width 0."""
  busy = [d for d in range(n) if d not in zeros]
  owned = [[] for _ in range(n)]
  perm = [int(u) for u in rng.permutation(num_units)]
  for i, d in enumerate(busy[:num_units]):
    owned[d].append(perm[i])
  for u in perm[len(busy):]:
    owned[busy[int(rng.integers(len(busy)))]].append(u)
  counts = tuple(len(o) for o in owned)
  capacity = max(counts) + 1
  return L.UnitLayout(kind, num_units, tuple(map(tuple, owned)), capacity, counts,
                      L.default_widths(capacity, 3, zero=0 in counts))


def random_layout(seed, n, num_kv_heads=KW["num_kv_heads"], drained=()):
  """Uneven MLP units and KV groups; the devices in `drained` own nothing of either kind."""
  rng = np.random.default_rng(seed)
  no_heads = tuple(drained) + tuple(int(d) for d in rng.choice(
      [d for d in range(n) if d not in drained], size=max(0, n - len(drained) - num_kv_heads),
      replace=False))
  return L.Layout(mlp=random_units(rng, "mlp", KW["d_ff"], n, drained),
                  heads=random_units(rng, "heads", num_kv_heads, n, no_heads))


def batch(seed=0, batch_size=4):
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, KW["vocab_size"], (batch_size, KW["seq_len"] + 1)).astype(np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


def logical_grads(eng, grads, layout):
  grads = eng.to_logical(engine_lib.TrainState(grads, eng.tx.init(grads)), layout).params
  return eng.logical_arrays(grads)


def check(eng, layout, seed=0, **plan):
  """Engine logits and gradients on `layout` (and `plan`'s options of `Engine.plan`) against
  the reference's, from the same initial parameters; returns the logits and the logical
  gradients."""
  logical = eng.init_logical(seed)
  state = eng.to_padded(logical, layout)
  batch_np = batch(seed)
  logits, grads = H.logits_and_grads(eng, state.params, eng.shard_batch(batch_np),
                                     eng.plan(layout, **plan))
  ref_logits, ref_grads = ref.logits_and_grads(
      jax.tree.map(jnp.asarray, eng.logical_arrays(logical.params)),
      jax.tree.map(jnp.asarray, batch_np), KW["num_heads"])
  fwd = float(np.abs(np.asarray(logits) - np.asarray(ref_logits)).max())
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=ATOL, rtol=1e-5)
  for _, _, _, padding in H.split_slots(eng, grads, layout):
    assert np.all(padding == 0)
  got = logical_grads(eng, grads, layout)
  H.assert_trees_close(got, ref_grads, atol=ATOL)
  grad = max(float(np.abs(np.asarray(a) - np.asarray(b)).max())
             for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref_grads)))
  print(f"\nreference: forward max abs {fwd:.2e}, gradient max abs {grad:.2e}")
  return logits, got


@pytest.mark.parametrize("seed,data,tensor,kv,drained,kernel,remat", [
    (1, 1, 8, 4, (), "auto", "none"),        # 4 KV groups on 8 devices: four own no group
    (2, 1, 8, 2, (5,), "auto", "full"),      # device 5 owns nothing: it skips the head
    (3, 2, 4, 1, (), "auto", "none"),        # multi-query attention, data x tensor
    (4, 1, 8, 8, (), "auto", "minimal"),     # multi-head attention (one query head per group)
    (5, 1, 4, 2, (2,), "pallas", "none"),    # the pallas width kernel (no branches)
])
def test_uneven_layouts_match_the_dense_reference(seed, data, tensor, kv, drained, kernel, remat):
  """(`remat`: the blocks rematerialized, `core.remat`, must compute the same numbers.)"""
  layout = random_layout(seed, tensor, kv, drained)
  assert 0 in layout.heads.counts or kv >= tensor
  assert layout.drained() == tuple(drained)
  eng = make_engine(data, tensor, kernel=kernel, num_kv_heads=kv,
                    precision=precision_lib.Precision(remat_policy=remat))
  assert eng.num_units == {"mlp": KW["d_ff"], "heads": kv} and eng.unit_sizes["heads"] == 1
  check(eng, layout, seed=seed)


def test_tied_embeddings_match_the_dense_reference():
  eng = make_engine(1, 4, tie_embeddings=True)
  logical = eng.logical_arrays(eng.init_logical(0).params)
  assert "head" not in logical
  layout = random_layout(6, 4, drained=(1,))    # a drained device skips the tied head too
  assert layout.drained() == (1,)
  _, grads = check(eng, layout)
  # The tied table gets the gradient of its two uses: the lookup and the head.
  assert np.abs(grads["embed"]["embedding"]).sum() > 0


def test_offloaded_groups_and_units_match_the_dense_reference():
  # Helpers compute a straggler's KV groups and MLP units from its weights (the authors'
  # offload): a device that owns three groups keeps one and has two computed by others.
  eng = make_engine(1, 4)
  layout = L.Layout(mlp=L.UnitLayout.from_counts("mlp", (20, 8, 12, 8), widths=(10, 20)),
                    heads=L.UnitLayout.from_counts("heads", (3, 0, 1, 0), widths=(1, 3)))
  desc = {"mlp": offload.for_target(layout.mlp, (12, 12, 12, 12)),
          "heads": offload.for_target(layout.heads, (1, 1, 1, 1))}
  assert desc["heads"] == {0: {1: 1, 3: 1}}
  check(eng, layout, offload=desc)


def test_inactive_groups_are_skipped_exactly():
  # active < owned: the skipped groups and units contribute nothing, as if their weights were 0.
  eng = make_engine(1, 4, tx=optax.sgd(0.1))
  full = L.Layout.for_model(d_model=32, num_heads=4, d_ff=48, num_devices=4)  # 4 KV groups
  layout = full.replace(mlp=full.mlp.with_active((12, 5, 0, 12)),
                        heads=full.heads.with_active((1, 0, 1, 1)))
  logical = eng.logical_arrays(eng.init_logical(0).params)
  params = jax.tree.map(np.array, logical)
  for block in params["encoder"]["blocks"].values():
    for d, (c, a) in enumerate(zip(full.mlp.counts, layout.mlp.active)):
      block["mlp"]["w_down"][d * 12 + a: d * 12 + c] = 0
    block["attn"]["wo"][1] = 0
  state = eng.to_padded(eng.init_logical(0), layout)
  logits = eng.logits(state.params, eng.shard_batch(batch()), eng.plan(layout))
  ref_logits = ref.logits(jax.tree.map(jnp.asarray, params), jnp.asarray(batch()["inputs"]),
                          KW["num_heads"])
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=ATOL, rtol=1e-5)


# --- ZERO-resizing --------------------------------------------------------------------------


def dense_equivalent(eng, layout, rz, params):
  """The logical parameters of the dense model a resized step computes (zero imputation): in
  units mode the skipped units' weights zeroed; in contraction mode the skipped input features
  of each device's column weights, and the skipped units' row weights."""
  out = jax.tree.map(np.array, params)
  leaves = jax.tree_util.tree_leaves_with_path(eng.axes)
  for (path, a), x in zip(leaves, jax.tree.leaves(out)):
    role, layer = resize_lib.role(a), sharding.block_index(path)
    if role is None or layer is None:
      continue
    axis, kind = a.unit()
    u = layout.kinds()[kind]
    xm = np.moveaxis(x, axis, 0)                      # a view: unit axis first
    for d in range(layout.num_devices):
      units = np.asarray(u.owned[d][:u.active[d]], int)
      kept = rz.order[kind][d, layer, :rz.kept[kind][d, layer]]
      skipped = units[np.setdiff1d(np.arange(len(units)), kept)]
      if rz.mode == "units" or role == "row":
        xm[skipped] = 0.0
      else:                                           # a column weight: [units, d_model, ...]
        feats = np.flatnonzero(rz.feat_skip[kind][d, layer])
        xm[np.ix_(units, feats)] = 0.0
  return out


@pytest.mark.parametrize("mode", resize_lib.MODES)
def test_resized_step_matches_the_dense_equivalent(mode):
  eng = make_engine(1, 4)
  mlp = random_layout(7, 4).mlp
  # Devices 0 and 2 own two KV groups each and keep half: each skips one group per layer.
  layout = L.Layout(mlp=mlp.replace(widths=L.default_widths(mlp.capacity, 2)),
                    heads=L.UnitLayout("heads", 4, ((3, 0), (), (1, 2), ()), 2, (2, 0, 2, 0),
                                       (0, 2)))
  spec = resize_spec_lib.ResizeSpec(keep=(0.5, 1.0, 0.5, 0.25), mode=mode, priority="random",
                                    fractions=(0.5, 1.0)).validate(4)
  pr = priority_lib.Priority(spec, num_layers=KW["num_layers"], d_model=KW["d_model"],
                             num_units=eng.num_units, unit_sizes=eng.unit_sizes, num_devices=4)
  rz = pr.select(layout, spec.keep)
  assert rz.skip["heads"].sum() == 2 * 2 and rz.skip["mlp"].sum() > 0
  logical = eng.logical_arrays(eng.init_logical(0).params)
  dense = dense_equivalent(eng, layout, rz, logical)
  state = eng.to_padded(eng.init_logical(0), layout)
  batch_np = batch()
  plan = eng.plan(layout, resize=rz)
  logits, grads = H.logits_and_grads(eng, state.params, eng.shard_batch(batch_np), plan)
  ref_logits, ref_grads = ref.logits_and_grads(jax.tree.map(jnp.asarray, dense),
                                               jax.tree.map(jnp.asarray, batch_np),
                                               KW["num_heads"])
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=3e-5, rtol=1e-5)
  exact = eng.logits(state.params, eng.shard_batch(batch_np), eng.plan(layout))
  assert np.abs(np.asarray(exact) - np.asarray(logits)).max() > 1e-3      # it did resize
  # The skip masks (what freeze holds) cover the skipped entries, whatever the weight's rank.
  masks = jax.jit(lambda p: resize_lib.skip_masks(p.resize, p.active, eng.axes,
                                                  eng.unit_sizes))(plan)
  masks = jax.tree.map(lambda m, x: np.broadcast_to(np.asarray(m), x.shape).astype(np.float32),
                       masks, state.params)
  masks = logical_grads(eng, jax.device_put(masks, eng.param_shardings), layout)
  for m, x, y in zip(jax.tree.leaves(masks), jax.tree.leaves(logical), jax.tree.leaves(dense)):
    np.testing.assert_array_equal(m == 1, x != y)
  for g, r, m in zip(jax.tree.leaves(logical_grads(eng, grads, layout)),
                     jax.tree.leaves(ref_grads), jax.tree.leaves(masks)):
    np.testing.assert_allclose(np.asarray(g)[m == 0], np.asarray(r)[m == 0], atol=3e-5,
                               rtol=1e-5)


# --- training ---------------------------------------------------------------------------------


def train(eng, state, layout, batches, losses, first=0, count=None):
  for i in range(first, first + (count or len(batches))):
    state, m = eng.train_step(state, batches[i % len(batches)], eng.plan(layout))
    losses.append(float(m["loss"]))
  return state


def assert_close_params(eng, a, layout_a, b, layout_b, rel=1e-5):
  got, want = (jax.tree_util.tree_leaves_with_path(eng.logical_arrays(eng.to_logical(s, lay)
                                                                      .params))
               for s, lay in ((a, layout_a), (b, layout_b)))
  for (path, x), (_, y) in zip(got, want):
    assert np.max(np.abs(x - y)) <= rel * np.max(np.abs(y)), jax.tree_util.keystr(path)


@pytest.fixture(scope="module")
def runs():
  """4 steps on the even layout of 4 devices, on an uneven one, and 2 uneven steps, a
  migration, 2 steps on the layout it moved to."""
  eng = make_engine(1, 4)
  even = L.Layout.for_model(d_model=32, num_heads=4, d_ff=48, num_devices=4)
  a = L.Layout(mlp=random_layout(8, 4).mlp,
               heads=L.UnitLayout.from_counts("heads", (2, 0, 1, 1), capacity=2))
  b = migrate.move_units(a, {"mlp": [(a.mlp.owned[0][0], 1), (a.mlp.owned[2][-1], 3)],
                             "heads": [(a.heads.owned[0][0], 1)]})
  assert a.bucket() == b.bucket() and b.heads.counts == (1, 1, 1, 1)
  batches = [eng.shard_batch(batch(seed=100 + i, batch_size=8)) for i in range(2)]
  out = {"eng": eng, "a": a, "b": b, "even": even}
  out["even_losses"], out["a_losses"], out["mig_losses"] = [], [], []
  out["even_state"] = train(eng, eng.init(0, even), even, batches, out["even_losses"], count=4)
  out["a_state"] = train(eng, eng.init(0, a), a, batches, out["a_losses"], count=4)
  start = train(eng, eng.init(0, a), a, batches, out["mig_losses"], count=2)
  mig = migrate.Migrator.for_engine(eng)
  moved = mig.migrate_state(start, migrate.plan(a, b), eng.tx, eng.axes)
  out["mig_state"] = train(eng, moved, b, batches, out["mig_losses"], first=2, count=2)
  return out


def test_an_uneven_split_trains_like_the_even_one(runs):
  assert runs["a_losses"][-1] < runs["a_losses"][0]
  np.testing.assert_allclose(runs["a_losses"], runs["even_losses"], rtol=2e-6, atol=0)
  assert_close_params(runs["eng"], runs["a_state"], runs["a"], runs["even_state"], runs["even"])


def test_a_migration_mid_run_equals_the_run_without_it(runs):
  np.testing.assert_allclose(runs["mig_losses"], runs["a_losses"], rtol=2e-6, atol=0)
  assert_close_params(runs["eng"], runs["mig_state"], runs["b"], runs["a_state"], runs["a"])


# --- spec -------------------------------------------------------------------------------------


def test_the_spec_counts_kv_groups_swiglu_and_gqa():
  spec = models.spec("llama", KW)
  assert spec.num_units() == {"mlp": 48, "heads": 4} and spec.unit_sizes() == {"mlp": 1,
                                                                                 "heads": 1}
  d, hd, g, s, v = 32, 4, 2, 8, 64
  # An MLP unit: a column of w_gate and of w_up, a row of w_down. A KV group: g query heads'
  # columns of wq and rows of wo, one head's of wk and of wv, and g heads' causal products.
  assert spec.flops_per_unit() == {"mlp": 6 * d, "heads": 2 * d * hd * (2 * g + 2)
                                   + g * 2 * 2 * s * hd / 2}
  assert spec.unit_params() == {"mlp": 3 * d, "heads": d * hd * (2 * g + 2)}
  eng = make_engine(1, 2)
  logical = eng.logical_arrays(eng.init_logical(0).params)
  blocks = sum(x.size for x in jax.tree.leaves(logical["encoder"]["blocks"]))
  per_layer = sum(spec.unit_params()[k] * n for k, n in spec.num_units().items()) + 2 * d
  assert blocks == KW["num_layers"] * per_layer
  forward = KW["num_layers"] * (48 * 6 * d + 4 * (2 * d * hd * 6 + 2 * 2 * 2 * s * hd / 2))
  forward += 4 * d + 2 * d * v + 5 * v
  assert flops.forward_flops_per_token(spec) == pytest.approx(forward)
  # The planner's costs hold the same counts, and its parameters add up to the model's.
  costs = planner_costs.ModelCosts.from_spec(spec, device_gflops=1.0)
  assert costs.num_units == spec.num_units() and costs.unit_params == spec.unit_params()
  assert costs.flops_per_unit == spec.flops_per_unit()
  total = (KW["num_layers"] * (costs.layer_params + sum(
      costs.unit_params[k] * n for k, n in costs.num_units.items()))
      + costs.first_params + costs.last_params)
  assert total == sum(x.size for x in jax.tree.leaves(logical))
  tied = models.spec("llama", dict(KW, tie_embeddings=True))
  assert planner_costs.ModelCosts.from_spec(tied, 1.0).last_params == d
  # The GPT's spec is unchanged by the new fields.
  gpt = models.spec("gpt", H.GPT_KW)
  assert gpt.num_units() == {"mlp": 48, "heads": 8} and gpt.unit_sizes()["heads"] == 4
  assert gpt.unit_params() == {"mlp": 2 * 32 + 1, "heads": 4 * 32 * 4 + 3 * 4}


@pytest.mark.parametrize("field,value,message", [
    ("num_kv_heads", 3, r"^config.model.num_kv_heads: 3 key/value heads must divide num_heads"),
    ("num_kv_heads", 16, r"^config.model.num_kv_heads: 16 key/value heads must divide"),
    ("num_kv_heads", 0, r"^config.model.num_kv_heads: must be an integer >= 1, got 0"),
    ("num_heads", 32, r"^config.model.num_heads: head_dim = d_model / num_heads = 1 must be even"),
    ("d_model", 24, r"^config.model.num_heads: head_dim = d_model / num_heads = 3 must be even"),
    ("num_heads", 5, r"^config.model.num_heads: 5 heads do not divide"),
    ("tie_embeddings", 1, r"^config.model.tie_embeddings: must be True or False, got 1"),
    ("bias", True, r"^config.model.bias: unknown field for model 'llama'"),
])
def test_bad_fields_are_refused_by_name(field, value, message):
  with pytest.raises(ConfigError, match=message):
    models.spec("llama", dict(KW, **{field: value}))

