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


def test_row_parallel_with_offload_needs_unit_axes():
  # The offload path gathers the offloaded units of every weight, so it needs their unit axes.
  x = jnp.ones((3, 8))
  plan = plan_lib.Plan({"mlp": jnp.zeros((1,), jnp.int32)}, (("mlp", WIDTHS),), offload={})
  with pytest.raises(ValueError, match=r"^tp.row_parallel.units: offload needs"):
    tp.row_parallel(plan, "mlp", kernels.mlp_partial, x, *_mlp_weights(jax.random.key(0)))
