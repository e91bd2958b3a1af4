"""The pallas width kernel (`core.width_gemm`): the limited GEMMs against numpy, their backward
passes against masked dense GEMMs, whole models against the `switch` kernel and the dense
reference (Pallas interpret mode on CPU), and the programs that GPUs and TPUs would run lowered
here for them: the kernel as Triton or Mosaic, and no conditional around the blocks."""

import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers
from semijax.core import engine as engine_lib
from semijax.core import layout as layout_lib
from semijax.core import plan as plan_lib
from semijax.core import width_gemm


def _limited(a, b, limit, dim, trans_a, trans_b):
  """numpy: the product with the entries past `limit` along `dim` left out (see `matmul`)."""
  a, b = (a.T if trans_a else a), (b.T if trans_b else b)
  if dim == "k":
    return a[:, :limit] @ b[:limit]
  out = a @ b
  if dim == "n":
    return out * (np.arange(out.shape[1]) < limit)
  return out * (np.arange(out.shape[0]) < limit)[:, None]


@pytest.mark.parametrize("dim", width_gemm.DIMS)
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True),
                                             (True, True)])
def test_matmul_leaves_out_the_entries_past_the_limit(dim, trans_a, trans_b):
  # Tiles of 16 on sizes that are not whole tiles (padded inside): tiles skipped, computed and
  # straddling the limit, limits inside a tile, on a tile edge, zero, the whole size and past
  # it; one compiled program for all of them.
  rng = np.random.default_rng(0)
  m, k, n = 80, 72, 40
  a = rng.normal(size=(k, m) if trans_a else (m, k)).astype(np.float32)
  b = rng.normal(size=(n, k) if trans_b else (k, n)).astype(np.float32)
  fn = jax.jit(functools.partial(width_gemm.matmul, dim=dim, trans_a=trans_a, trans_b=trans_b,
                                 tiles=(16, 16, 16)))
  size = {"m": m, "n": n, "k": k}[dim]
  for limit in (0, 1, 19, 32, size - 1, size, size + 7):
    want = _limited(a, b, min(limit, size), dim, trans_a, trans_b)
    np.testing.assert_allclose(np.asarray(fn(a, b, jnp.int32(limit))), want, atol=1e-4,
                               rtol=1e-5, err_msg=f"limit {limit}")
  assert fn._cache_size() == 1


def test_matmul_rejects_a_bad_dim_and_mismatched_contractions():
  a, b = jnp.ones((16, 16)), jnp.ones((8, 16))
  with pytest.raises(ValueError, match="width_gemm.matmul.dim"):
    width_gemm.matmul(a, a, 3, "x")
  with pytest.raises(ValueError, match="contraction sizes differ"):
    width_gemm.matmul(a, b, 3, "k")


@pytest.mark.parametrize("limit", [0, 5, 13, 24])
def test_column_and_row_gradients_match_masked_dense_gemms(limit):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 8, 32)), jnp.float32)
  w1 = jnp.asarray(rng.normal(size=(32, 24)), jnp.float32)
  w2 = jnp.asarray(rng.normal(size=(24, 32)), jnp.float32)
  mask = jnp.arange(24) < limit

  def kernel(x, w1, w2):
    h = jnp.tanh(width_gemm.column(x, w1, jnp.int32(limit)))
    return jnp.sum(jnp.sin(width_gemm.row(h, w2, jnp.int32(limit))))

  def dense(x, w1, w2):
    h = jnp.tanh((x @ w1) * mask) * mask
    return jnp.sum(jnp.sin(h @ w2))

  got = jax.value_and_grad(kernel, argnums=(0, 1, 2))(x, w1, w2)
  want = jax.value_and_grad(dense, argnums=(0, 1, 2))(x, w1, w2)
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, atol=1e-4, rtol=1e-5), got, want)
  _, (_, g1, g2) = got             # the units past the limit get exactly zero gradient
  assert not np.any(np.asarray(g1)[:, limit:]) and not np.any(np.asarray(g2)[limit:])


def test_auto_picks_pallas_on_accelerators_and_a_bad_name_names_the_field():
  assert width_gemm.resolve("auto", "gpu") == width_gemm.resolve("auto", "tpu") == "pallas"
  assert width_gemm.resolve("auto", "cpu") == "switch"
  assert width_gemm.resolve("switch", "gpu") == "switch"
  assert width_gemm.resolve("pallas", "cpu") == "pallas"
  with pytest.raises(ValueError, match="layout.kernel"):
    width_gemm.resolve("triton")


def _uneven_engines(seed, tensor, model="gpt"):
  layout = helpers.random_layout(seed, tensor, model)
  engines = {k: helpers.make_engine(model, 1, tensor, kernel=k) for k in ("switch", "pallas")}
  return layout, engines


@pytest.mark.parametrize("model,seed,tensor", [("gpt", 1, 4), ("vit", 4, 2)])
def test_a_random_uneven_layout_matches_the_switch_kernel_and_the_reference(model, seed,
                                                                            tensor):
  layout, engines = _uneven_engines(seed, tensor, model)
  logical = engines["switch"].init_logical(seed)
  batch_np = helpers.make_batch(model, seed)
  out = {}
  for kernel, eng in engines.items():
    state = eng.to_padded(logical, layout)
    plan = eng.plan(layout)
    assert plan.kernel == kernel
    assert all(plan.runs_pallas(k) == (kernel == "pallas") for k in ("mlp", "heads"))
    out[kernel] = helpers.logits_and_grads(eng, state.params, eng.shard_batch(batch_np), plan)
  helpers.assert_trees_close(out["pallas"], out["switch"], atol=2e-5)
  ref_logits, _ = helpers.reference_logits_and_grads(model, logical.params, batch_np)
  np.testing.assert_allclose(np.asarray(out["pallas"][0]), np.asarray(ref_logits), atol=2e-5,
                             rtol=1e-5)
  for _, _, _, padding in helpers.split_slots(engines["pallas"], out["pallas"][1], layout):
    assert np.all(padding == 0)


def test_an_even_split_in_a_larger_bucket_matches_the_dense_reference():
  eng = helpers.make_engine("gpt", 1, 4, kernel="pallas")
  even = helpers.even_layout(4)
  layout = layout_lib.Layout(**{k: u.replace(capacity=2 * u.capacity,
                                             widths=layout_lib.default_widths(2 * u.capacity, 4))
                                for k, u in even.kinds().items()})
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, layout)
  batch_np = helpers.make_batch("gpt")
  plan = eng.plan(layout)
  assert plan.runs_pallas("mlp") and plan.runs_pallas("heads")
  logits, grads = helpers.logits_and_grads(eng, state.params, eng.shard_batch(batch_np), plan)
  ref_logits, ref_grads = helpers.reference_logits_and_grads("gpt", logical.params, batch_np)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(ref_logits), atol=2e-5, rtol=1e-5)
  grads = eng.to_logical(engine_lib.TrainState(grads, eng.tx.init(grads)), layout).params
  helpers.assert_trees_close(grads, ref_grads, atol=2e-5)


@pytest.mark.parametrize("platform,marker", [("cuda", "__gpu$xla.gpu.triton"),
                                             ("tpu", "tpu_custom_call")])
def test_the_accelerator_program_runs_the_kernel_without_a_conditional(platform, marker):
  # What a GPU or TPU would compile, lowered here: under `pallas` the blocks are kernel calls
  # (Triton / Mosaic) and the step has no conditional; under `switch` it has one per block.
  eng = helpers.make_engine("gpt", 1, 2, kernel="pallas")
  layout = helpers.random_layout(3, 2)
  state = eng.init(0, layout)
  batch = eng.shard_batch(helpers.make_batch("gpt"))
  backend = {"cuda": "gpu", "tpu": "tpu"}[platform]

  def lowered(kernel):
    plan = dataclasses.replace(eng.plan(layout), kernel=kernel)
    fn = jax.jit(jax.grad(lambda p, b, pl: eng.loss(p, b, pl)[0]))
    with mock.patch.object(jax, "default_backend", lambda: backend):
      return fn.trace(state.params, batch, plan).lower(lowering_platforms=(platform,)).as_text()

  pallas, switch = lowered("pallas"), lowered("switch")
  # Per layer, forward: a column and a row GEMM in the MLP, three columns and a row in the
  # attention; backward: two GEMMs for each of them.
  assert pallas.count(marker) == helpers.MODELS["gpt"][2]["num_layers"] * (2 + 4) * 3
  assert "stablehlo.case" not in pallas
  assert marker not in switch and "stablehlo.case" in switch


def test_executed_widths_under_the_pallas_kernel_are_the_active_counts():
  layout = helpers.random_layout(2, 4)
  switch = plan_lib.executed_widths(layout, 2, kernel="switch")
  pallas = plan_lib.executed_widths(layout, 2, kernel="pallas")
  for kind, u in layout.kinds().items():
    np.testing.assert_array_equal(pallas[kind][:, 0], u.active)
    bucket = [min(w for w in u.widths if w >= a) for a in u.active]
    np.testing.assert_array_equal(switch[kind][:, 0], bucket)
  assert any(np.any(switch[k] > pallas[k]) for k in switch)


def test_the_kernel_is_chosen_per_kind_and_executed_widths_agree():
  # A kind compiled at one width runs that width plainly, even where the other kind runs the
  # pallas kernel; the host's mirror of what each device executes says the same.
  layout = helpers.random_layout(2, 4)
  one_width = {"heads": (layout.heads.capacity,)}
  plan = plan_lib.Plan(dict(layout.kinds()), tuple(dict(
      {k: u.widths for k, u in layout.kinds().items()}, **one_width).items()), kernel="pallas")
  assert plan.runs_pallas("mlp") and not plan.runs_pallas("heads")
  executed = plan_lib.executed_widths(layout, 1, widths=one_width, kernel="pallas")
  np.testing.assert_array_equal(executed["mlp"][:, 0], layout.mlp.active)
  assert np.all(executed["heads"] == layout.heads.capacity)
