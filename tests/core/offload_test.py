"""Offload (helpers compute a straggler's units) against the plain dense computation.

Outputs and gradients of the column- and row-parallel GEMMs and of the MLP and attention blocks
must match a single-device dense computation in fp32, with several stragglers, a helper that
serves two of them (two ppermute rounds) and uneven, non-contiguous layouts on 8 fake devices.

Wired into training (`Engine.plan(offload=...)`): a tiny GPT trains exactly as without offload,
one compiled step serves every offload amount, and the host helpers (`for_target`,
`step_bytes`) and bad inputs are checked.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import helpers as H
from semijax.core import engine as engine_lib
from semijax.core import kernels
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import offload
from semijax.core import plan as plan_lib
from semijax.models import gpt
from semijax.models import tasks

N, D, FF, HEADS, HD = 8, 16, 40, 8, 2
ATOL = 2e-5
TENSOR = mesh_lib.TENSOR


@pytest.fixture(scope="module")
def setup():
  return make_setup()


def make_setup():
  mesh = mesh_lib.make_mesh(1, N)
  rng = np.random.default_rng(0)
  mlp = H.random_unit_layout(rng, "mlp", FF, N)
  # Heads: device 1 owns three, so it can offload two.
  heads = L.UnitLayout("heads", HEADS, ((0,), (5, 2, 7), (1,), (3,), (4,), (6,), (), ()), 4,
                       (1, 3, 1, 1, 1, 1, 0, 0), (2, 4))
  s1, s2 = [d for d in range(N) if mlp.counts[d] >= 4][:2]
  helpers = [d for d in range(N) if d not in (s1, s2)]
  offloads = {
      "mlp": {s1: {helpers[0]: 2, helpers[1]: 1, helpers[2]: 1}, s2: {helpers[1]: 2}},
      "heads": {1: {3: 1, 7: 1}},
  }
  k = jax.random.split(jax.random.key(1), 12)
  w = {"w1": jax.random.normal(k[0], (D, FF)) / 4, "b1": jax.random.normal(k[1], (FF,)),
       "w2": jax.random.normal(k[2], (FF, D)) / 6,
       **{f"w{n}": jax.random.normal(k[3 + i], (D, HEADS * HD)) / 4 for i, n in enumerate("qkv")},
       **{f"b{n}": jax.random.normal(k[6 + i], (HEADS * HD,)) for i, n in enumerate("qkv")},
       "wo": jax.random.normal(k[9], (HEADS * HD, D)) / 4}
  x = jax.random.normal(k[10], (2, 5, D))
  ct = jax.random.normal(k[11], (2, 5, D))
  return dict(mesh=mesh, mlp=mlp, heads=heads, offloads=offloads, w=w, x=x, ct=ct)


AXES = {"w1": (1, "mlp"), "b1": (0, "mlp"), "w2": (0, "mlp"), "wq": (1, "heads"),
        "bq": (0, "heads"), "wk": (1, "heads"), "bk": (0, "heads"), "wv": (1, "heads"),
        "bv": (0, "heads"), "wo": (0, "heads")}
SIZE = {"mlp": 1, "heads": HD}


def pack(s, w):
  lay = {"mlp": s["mlp"], "heads": s["heads"]}
  return {n: lay[k].pack(w[n], a, SIZE[k]) for n, (a, k) in AXES.items()}


def unpack(s, w):
  lay = {"mlp": s["mlp"], "heads": s["heads"]}
  return {n: lay[k].unpack(w[n], a, SIZE[k]) for n, (a, k) in AXES.items()}


def spec(name):
  a, _ = AXES[name]
  return P(*[TENSOR if i == a else None for i in range(2 if name[0] == "w" else 1)])


def dense_mlp(w, x):
  return jax.nn.gelu(x @ w["w1"] + w["b1"]) @ w["w2"]


def dense_attention(w, x):
  b, t, _ = x.shape
  heads = lambda n: (x @ w[f"w{n}"] + w[f"b{n}"]).reshape(b, t, HEADS, HD)
  q, k, v = heads("q"), heads("k"), heads("v")
  logits = jnp.einsum("bqhd,bkhd->bhqk", q / math.sqrt(HD), k)
  logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, jnp.finfo(logits.dtype).min)
  out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
  return out.reshape(b, t, HEADS * HD) @ w["wo"]


def dense_block(w, x):
  return dense_attention(w, x) + dense_mlp(w, x)


def sharded(s, body, plans):
  specs = {n: spec(n) for n in AXES}
  plan_specs = {k: p.specs() for k, p in plans.items()}
  return jax.shard_map(body, mesh=s["mesh"], in_specs=(plan_specs, specs, P()), out_specs=P())


def plans_for(s, offloads):
  return {k: offload.make_plan(s[k], offloads.get(k, {}), s["mesh"]) for k in ("mlp", "heads")}


def check_grads(s, grads, ref_grads):
  for name, g in unpack(s, grads).items():
    np.testing.assert_allclose(np.asarray(g), np.asarray(ref_grads[name]), atol=ATOL, rtol=1e-5,
                               err_msg=name)


@pytest.mark.parametrize("with_offload", [True, False])
def test_blocks_with_offload_match_dense_outputs_and_gradients(setup, with_offload):
  s = setup
  mlp_widths = L.default_widths(s["mlp"].capacity, 3)
  plans = plans_for(s, s["offloads"] if with_offload else {})
  if with_offload:
    # The stragglers compute fewer units themselves (so a smaller bucket width).
    keep = np.asarray(plans["mlp"].keep)
    for d, share in s["offloads"]["mlp"].items():
      assert keep[d] == s["mlp"].counts[d] - sum(share.values())
    # Straggler 1 has three helpers (three ppermute rounds); helper 1 serves both stragglers.
    rounds = plans["mlp"].rounds
    assert len(rounds) == 3 and sum(dst == 1 for r in rounds for _, dst in r) == 2
    assert plans["heads"].chunk == 1

  def body(plans, w, x):
    att = offload.attention_block(plans["heads"], s["heads"].widths, x, *[w[n] for n in (
        "wq", "bq", "wk", "bk", "wv", "bv", "wo")], head_dim=HD, causal=True)
    return att + offload.mlp_block(plans["mlp"], mlp_widths, x, w["w1"], w["b1"], w["w2"])

  fn = sharded(s, body, plans)
  loss = lambda w, x: jnp.sum(fn(plans, w, x) * s["ct"])
  out, (gw, gx) = jax.jit(lambda w, x: (fn(plans, w, x), jax.grad(loss, (0, 1))(w, x)))(
      pack(s, s["w"]), s["x"])
  ref_loss = lambda w, x: jnp.sum(dense_block(w, x) * s["ct"])
  ref_gw, ref_gx = jax.grad(ref_loss, (0, 1))(s["w"], s["x"])
  np.testing.assert_allclose(np.asarray(out), np.asarray(dense_block(s["w"], s["x"])),
                             atol=ATOL, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), atol=ATOL, rtol=1e-5)
  check_grads(s, gw, ref_gw)
  # Gradients of padded slots are exactly zero (the straggler keeps zero moments there).
  for name, (a, kind) in AXES.items():
    mask = np.repeat(s[kind].owned_mask(), SIZE[kind])
    assert not np.any(np.take(np.asarray(gw[name]), np.nonzero(~mask)[0], axis=a)), name


def test_column_and_row_parallel_gemms_match_dense(setup):
  # The MLP as two separate GEMMs: column-parallel (helpers send results back) and row-parallel
  # (the straggler sends its input shard with the weights).
  s = setup
  plans = plans_for(s, s["offloads"])

  def body(plans, w, x):
    h = offload.column_parallel(plans["mlp"], x, w["w1"], w["b1"])
    y = offload.row_parallel_gemm(plans["mlp"], jax.nn.gelu(h), w["w2"])
    hq = offload.column_parallel(plans["heads"], x, w["wq"], w["bq"], unit_size=HD)
    return y + offload.row_parallel_gemm(plans["heads"], hq, w["wo"], unit_size=HD)

  fn = sharded(s, body, plans)
  loss = lambda w, x: jnp.sum(fn(plans, w, x) * s["ct"])
  out, (gw, gx) = jax.jit(lambda w, x: (fn(plans, w, x), jax.grad(loss, (0, 1))(w, x)))(
      pack(s, s["w"]), s["x"])
  dense = lambda w, x: dense_mlp(w, x) + (x @ w["wq"] + w["bq"]) @ w["wo"]
  ref_gw, ref_gx = jax.grad(lambda w, x: jnp.sum(dense(w, x) * s["ct"]), (0, 1))(s["w"], s["x"])
  np.testing.assert_allclose(np.asarray(out), np.asarray(dense(s["w"], s["x"])), atol=ATOL,
                             rtol=1e-5)
  np.testing.assert_allclose(np.asarray(gx), np.asarray(ref_gx), atol=ATOL, rtol=1e-5)
  used = {"w1", "b1", "w2", "wq", "bq", "wo"}
  check_grads(s, {n: g for n, g in gw.items()},
              {n: (ref_gw[n] if n in used else jnp.zeros_like(ref_gw[n])) for n in AXES})


def test_column_parallel_output_shard_is_the_dense_columns(setup):
  s = setup
  plans = plans_for(s, s["offloads"])
  fn = jax.shard_map(lambda p, w, b, x: offload.column_parallel(p, x, w, b), mesh=s["mesh"],
                     in_specs=(plans["mlp"].specs(), P(None, TENSOR), P(TENSOR), P()),
                     out_specs=P(None, None, TENSOR))
  packed = pack(s, s["w"])
  y = jax.jit(fn)(plans["mlp"], packed["w1"], packed["b1"], s["x"])
  np.testing.assert_allclose(np.asarray(s["mlp"].unpack(y, 2)),
                             np.asarray(s["x"] @ s["w"]["w1"] + s["w"]["b1"]), atol=ATOL)
  pad = ~s["mlp"].owned_mask()
  assert not np.any(np.asarray(y)[..., pad])


@pytest.mark.parametrize("offloads, match", [
    ({9: {0: 1}}, r"^offload.mlp: straggler 9 is not a device"),
    ({0: {0: 1}}, r"^offload.mlp: helper 0 of device 0 is not another device"),
    ({0: {1: 99}}, r"^offload.mlp: device 0 offloads \{1: 99\} units but computes"),
])
def test_bad_offload_is_refused(setup, offloads, match):
  with pytest.raises(L.LayoutError, match=match):
    offload.make_plan(setup["mlp"], offloads)


def test_block_partial_charges_kept_bucket_plus_helped_chunks(setup):
  # The emulated sleep is charged for the executed width: a straggler's bucket width >= what it
  # keeps, a helper's own bucket plus one chunk per round in which it computes for a straggler.
  s = setup
  widths = L.default_widths(s["mlp"].capacity, 3)
  rounds, chunk = offload.static_shape(s["mlp"])
  plan = offload.make_plan(s["mlp"], s["offloads"]["mlp"], s["mesh"], chunk=chunk, rounds=rounds)
  assert len(plan.rounds) == N - 1 and plan.send.shape == (N, N - 1, chunk)

  def body(p, w1, b1, w2, x):
    y, executed = offload.block_partial(p, widths, kernels.mlp_partial, x, (w1, b1, w2),
                                        kernels.MLP_UNITS)
    return jax.lax.psum(y, TENSOR), executed.reshape(1)

  packed = pack(s, s["w"])
  fn = jax.shard_map(body, mesh=s["mesh"], in_specs=(plan.specs(), spec("w1"), spec("b1"),
                                                     spec("w2"), P()), out_specs=(P(), P(TENSOR)))
  y, executed = jax.jit(fn)(plan, packed["w1"], packed["b1"], packed["w2"], s["x"])
  np.testing.assert_allclose(np.asarray(y), np.asarray(dense_mlp(s["w"], s["x"])), atol=ATOL,
                             rtol=1e-5)
  keep = np.asarray(plan.keep)
  helped = (np.asarray(plan.count) > 0).sum(1)
  u = s["mlp"].replace(widths=widths)
  own = u.with_active(keep).executed_widths()
  np.testing.assert_array_equal(np.asarray(executed), np.asarray(own) + chunk * helped)
  for d in s["offloads"]["mlp"]:   # the stragglers execute less than without offload
    assert executed[d] < u.executed_widths()[d]
  # The host's mirror (what the emulation charges) agrees with the device.
  layout = L.Layout(mlp=u, heads=L.UnitLayout.even("heads", 8, N))
  host = plan_lib.executed_widths(layout, 2, offload={"mlp": s["offloads"]["mlp"]})
  np.testing.assert_array_equal(host["mlp"], np.repeat(np.asarray(executed)[:, None], 2, 1))


# --- wired into training ------------------------------------------------------------------------

LR = 0.1


def tiny_engine():
  """A one-layer GPT (d_model 32, 8 heads, d_ff 48) on 4 tensor devices: 3 offload rounds.

  Plain SGD: Adam would turn the rounding noise of gradients that are zero in exact arithmetic
  (the key biases: softmax ignores a constant per query) into lr-sized steps.
  """
  kw = dict(H.GPT_KW, num_layers=1)
  return engine_lib.Engine(lambda rngs: gpt.GPT(rngs=rngs, **kw), tasks.language_model,
                           mesh_lib.make_mesh(1, 4), optax.sgd(LR))


def tiny_layout():
  """MLP counts (15, 7, 25, 1) non-contiguous, heads (3, 1, 3, 1); two widths per kind."""
  lay = H.random_layout(2, 4)
  two = lambda u: u.replace(widths=L.default_widths(u.capacity, 2))
  return L.Layout(mlp=two(lay.mlp), heads=two(lay.heads))


def test_engine_step_with_offload_equals_step_without():
  eng, layout = tiny_engine(), tiny_layout()
  desc = {"mlp": offload.for_target(layout.mlp, (12, 12, 12, 12)),
          "heads": offload.for_target(layout.heads, (2, 2, 2, 2))}
  assert desc["heads"] == {0: {1: 1}, 2: {3: 1}}
  plain, off = eng.plan(layout), eng.plan(layout, offload=desc)
  assert np.asarray(off.offload["mlp"].keep).tolist() == [12, 7, 12, 1]
  assert off.exact() is not off and off.exact().offload is off.offload   # evaluation keeps it
  batch_np = H.make_batch("gpt", 1)
  batch = eng.shard_batch(batch_np)
  state = eng.init(0, layout)
  logits, grads = H.logits_and_grads(eng, state.params, batch, plain)
  np.testing.assert_allclose(np.asarray(eng.logits(state.params, batch, off)),
                             np.asarray(logits), atol=2e-5, rtol=1e-5)
  # One optimizer step: the plain step's loss and new parameters (SGD: p - lr * g). Checking
  # p - lr * g to 2e-6 checks the gradients to 2e-5 (and spares compiling their own program).
  new_off, m_off = eng.train_step(eng.init(0, layout), batch, off)
  logp = jax.nn.log_softmax(logits)
  loss = -np.mean(np.take_along_axis(np.asarray(logp), batch_np["targets"][..., None], -1))
  np.testing.assert_allclose(float(m_off["loss"]), loss, rtol=1e-5)
  want = jax.tree.map(lambda p, g: p - LR * g, state.params, grads)
  H.assert_trees_close(new_off.params, want, atol=2e-6)
  # Another offload amount (none for heads) and no offload at all reuse the compiled step and
  # take the plain step from the same state.
  compiled = eng.compile_count
  other = {"mlp": offload.for_target(layout.mlp, (10, 14, 14, 10))}
  for plan in (eng.plan(layout, offload=other), eng.plan(layout, offload={})):
    new, m = eng.train_step(eng.init(0, layout), batch, plan)
    np.testing.assert_allclose(float(m["loss"]), loss, rtol=1e-5)
    H.assert_trees_close(new.params, want, atol=2e-6)
  assert eng.compile_count == compiled


@pytest.mark.parametrize("seed", range(4))
def test_for_target_round_trips(seed):
  rng = np.random.default_rng(seed)
  u = H.random_unit_layout(rng, "mlp", 40, 8, extra_capacity=8)
  target = np.bincount(rng.integers(0, 8, 40 - 8), minlength=8) + 1   # each >= 1, sum 40
  desc = offload.for_target(u, target)
  assert offload.computed_counts(u, desc) == tuple(target)
  for s, helpers in desc.items():   # only devices above target send, only to those below
    assert u.active[s] > target[s] and all(u.active[h] < target[h] for h in helpers)
  rounds, _ = offload.static_shape(u)
  plan = offload.make_plan(u, desc, chunk=u.capacity, rounds=rounds)
  np.testing.assert_array_equal(plan.keep + plan.count.sum(1), target)


def test_step_bytes_counts_weights_out_and_gradients_back():
  desc = {"mlp": {0: {1: 3, 2: 1}}, "heads": {3: {0: 2}}}
  assert offload.step_bytes(desc, {"mlp": 100, "heads": 1000}) == 2 * (4 * 100 + 2 * 1000)
  assert offload.step_bytes({}, {}) == 0
  with pytest.raises(ValueError, match=r"^offload.unit_bytes: .*'heads'"):
    offload.step_bytes(desc, {"mlp": 100})


@pytest.mark.parametrize("target, match", [
    ((12, 12, 12), r"^offload.mlp.target: 3 entries for 4 devices"),
    ((24, 24, 0, 0), r"^offload.mlp.target: every device must compute at least 1"),
    ((12, 12, 12, 13), r"^offload.mlp.target: sums to 49, but the devices compute 48"),
])
def test_bad_target_is_refused(target, match):
  with pytest.raises(L.LayoutError, match=match):
    offload.for_target(tiny_layout().mlp, target)


def test_bad_engine_offload_is_refused():
  eng, layout = tiny_engine(), tiny_layout()
  with pytest.raises(ValueError, match=r"^offload: expected .* kinds in \['heads', 'mlp'\]"):
    eng.plan(layout, offload={"ffn": {0: {1: 1}}})
  with pytest.raises(ValueError, match=r"^offload: cannot be combined with resize"):
    eng.plan(layout, offload={}, resize=object())
  # chunk = capacity // 2 = 13: one pair cannot carry 14 units.
  with pytest.raises(L.LayoutError, match=r"^offload.mlp: chunk 13 is smaller than a pair"):
    eng.plan(layout, offload={"mlp": {2: {3: 14}}})
  with pytest.raises(L.LayoutError, match=r"^offload.heads: helper 4 of device 0"):
    eng.plan(layout, offload={"heads": {0: {4: 1}}})
