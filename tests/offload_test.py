"""Offload (helpers compute a straggler's units) against the plain dense computation.

Outputs and gradients of the column- and row-parallel GEMMs and of the MLP and attention blocks
must match a single-device dense computation in fp32, with several stragglers, a helper that
serves two of them (two ppermute rounds) and uneven, non-contiguous layouts on 8 fake devices.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers as H
from semijax import layout as L
from semijax import mesh as mesh_lib
from semijax import offload

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
