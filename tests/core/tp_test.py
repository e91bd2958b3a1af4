"""Bucketed column->row parallel ops: each width branch computes exactly what width C would."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from semijax.core import kernels
from semijax.core import plan as plan_lib
from semijax.core import tp

WIDTHS = (2, 4, 6, 8)


def _mlp_weights(key, d=8, c=8):
  k1, k2, k3 = jax.random.split(key, 3)
  return (jax.random.normal(k1, (d, c)), jax.random.normal(k2, (c,)),
          jax.random.normal(k3, (c, d)))


@pytest.mark.parametrize("active", [0, 1, 2, 3, 5, 8])
def test_at_width_equals_full_capacity_with_mask(active):
  x = jax.random.normal(jax.random.key(0), (3, 8))
  w1, b1, w2 = _mlp_weights(jax.random.key(1))
  a = jnp.int32(active)

  def loss(fn, x, w1, b1, w2):
    return jnp.sum(jnp.sin(fn(x, w1, b1, w2)))
  bucketed = lambda x, w1, b1, w2: kernels.at_width(a, WIDTHS, kernels.mlp_partial, x, w1, b1,
                                                    w2, a)
  full = lambda x, w1, b1, w2: kernels.mlp_partial(8, x, w1, b1, w2, a)
  got = jax.jit(jax.value_and_grad(functools.partial(loss, bucketed), argnums=(0, 1, 2, 3)))(
      x, w1, b1, w2)
  want = jax.value_and_grad(functools.partial(loss, full), argnums=(0, 1, 2, 3))(x, w1, b1, w2)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-5, rtol=1e-5), got, want)
  # Slots beyond `active` get exactly zero gradient.
  _, (_, g1, gb1, g2) = got
  assert not np.any(np.asarray(g1)[:, active:])
  assert not np.any(np.asarray(gb1)[active:]) and not np.any(np.asarray(g2)[active:])


def test_bucket_index_picks_smallest_width_at_least_active():
  got = [int(kernels.bucket_index(jnp.int32(a), WIDTHS)) for a in range(9)]
  assert got == [0, 0, 0, 1, 1, 2, 2, 3, 3]


def test_switch_runs_only_the_selected_width():
  # The compiled program contains one conditional whose branches have GEMMs of each width.
  x = jnp.ones((4, 8))
  w1, b1, w2 = _mlp_weights(jax.random.key(0))
  f = jax.jit(lambda a: kernels.at_width(a, WIDTHS, kernels.mlp_partial, x, w1, b1, w2, a))
  hlo = f.lower(jnp.int32(3)).compile().as_text()
  assert "conditional" in hlo
  for w in WIDTHS:
    assert f"f32[4,{w}]" in hlo, w


def test_attention_partial_heads_independent():
  # Computing 3 of 4 heads equals computing all 4 with the 4th head's output rows zeroed.
  d, hd, c = 8, 2, 4
  ks = jax.random.split(jax.random.key(3), 8)
  x = jax.random.normal(ks[0], (2, 5, d))
  ws = [jax.random.normal(k, s) for k, s in zip(
      ks[1:], [(d, c * hd), (c * hd,), (d, c * hd), (c * hd,), (d, c * hd), (c * hd,),
               (c * hd, d)])]
  fn = functools.partial(kernels.attention_partial, head_dim=hd, causal=True)
  three = fn(3, x, *ws, jnp.int32(3))
  wo = ws[-1].at[3 * hd:].set(0)
  four = fn(4, x, *ws[:-1], wo, jnp.int32(4))
  np.testing.assert_allclose(three, four, atol=1e-5, rtol=1e-5)


def attention_inputs(key, x_shape, hd, c):
  """x [batch, seq, d] and the weights wq, bq, wk, bk, wv, bv, wo of `c` heads of `hd`
  features, each normal over the square root of its fan-in."""
  d = x_shape[-1]
  shapes = [(d, c * hd), (c * hd,)] * 3 + [(c * hd, d)]
  ks = jax.random.split(key, len(shapes) + 1)
  x = jax.random.normal(ks[0], x_shape)
  return x, [jax.random.normal(k, s) / np.sqrt(s[0]) for k, s in zip(ks[1:], shapes)]


def einsum_attention(x, wq, bq, wk, bk, wv, bv, wo, heads, hd, causal):
  """The attention of the first `heads` heads, written out: einsums, a `tril` mask and a float32
  softmax (what the kernel computed before it called `jax.nn.dot_product_attention`)."""
  split = lambda w, b: (x @ w[:, :heads * hd] + b[:heads * hd]).reshape(
      *x.shape[:-1], heads, hd)
  q, k, v = split(wq, bq), split(wk, bk), split(wv, bv)
  logits = jnp.einsum("bqhd,bkhd->bhqk", q / np.sqrt(hd), k).astype(jnp.float32)
  if causal:
    seq = x.shape[-2]
    logits = jnp.where(jnp.tril(jnp.ones((seq, seq), bool)), logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1).astype(x.dtype)
  out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(*x.shape[:-1], heads * hd)
  return out @ wo[:heads * hd]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("width,active", [(4, 4), (4, 3), (6, 1)])
def test_attention_partial_equals_einsum_attention_forward_and_gradients(causal, width, active):
  hd, c = 4, 6
  x, ws = attention_inputs(jax.random.key(7), (2, 7, 16), hd, c)
  cot = jax.random.normal(jax.random.key(8), x.shape)
  fn = functools.partial(kernels.attention_partial, width, head_dim=hd, causal=causal,
                         implementation="xla")
  got = lambda x, *ws: jnp.sum(fn(x, *ws, jnp.int32(active)) * cot)
  want = lambda x, *ws: jnp.sum(einsum_attention(x, *ws, active, hd, causal) * cot)
  args = (x, *ws)
  np.testing.assert_allclose(fn(x, *ws, jnp.int32(active)),
                             einsum_attention(x, *ws, active, hd, causal), atol=1e-5, rtol=1e-5)
  g_got = jax.grad(got, argnums=tuple(range(8)))(*args)
  g_want = jax.grad(want, argnums=tuple(range(8)))(*args)
  for a, b in zip(g_got, g_want):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
  # The heads past `active` get no gradient.
  assert np.all(np.asarray(g_got[1])[:, active * hd:] == 0)


def test_attention_partial_in_bfloat16_matches_einsum_attention_of_the_rounded_inputs():
  # In bfloat16 (a float32 softmax inside), within bfloat16 steps of the written-out attention
  # of the same rounded inputs, and near the float32 result.
  hd, c = 8, 2
  x, ws = attention_inputs(jax.random.key(9), (1, 64, 16), hd, c)
  bf = lambda a: a.astype(jnp.bfloat16)
  out = kernels.attention_partial(c, bf(x), *map(bf, ws), jnp.int32(c), head_dim=hd,
                                  causal=True)
  assert out.dtype == jnp.bfloat16
  exact = einsum_attention(x, *ws, c, hd, True)
  rounded = einsum_attention(bf(x), *map(bf, ws), c, hd, True)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(rounded, np.float32),
                             atol=0.03, rtol=0.03)
  assert float(jnp.max(jnp.abs(out.astype(jnp.float32) - exact))) < 0.1


def test_row_parallel_with_offload_needs_unit_axes():
  # The offload path gathers the offloaded units of every weight, so it needs their unit axes.
  x = jnp.ones((3, 8))
  plan = plan_lib.Plan({"mlp": jnp.zeros((1,), jnp.int32)}, (("mlp", WIDTHS),), offload={})
  with pytest.raises(ValueError, match=r"^tp.row_parallel.units: offload needs"):
    tp.row_parallel(plan, "mlp", kernels.mlp_partial, x, *_mlp_weights(jax.random.key(0)))
