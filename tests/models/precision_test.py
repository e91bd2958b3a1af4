"""Mixed precision: what computes in the compute dtype, what stays float32, and what stays exact.

Compute dtype bfloat16 (`model.dtype`): activations, GEMMs and the tensor all-reduce run in it;
parameters, gradients, logits and the loss stay float32. An uneven split equals the even split
within bfloat16 round-off; migration and checkpoints are bit-exact in bfloat16 storage, and a
checkpoint of one precision restores into the other.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers as H
from semijax.core import engine as engine_lib
from semijax.core import precision as precision_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import loop as train

BF16 = precision_lib.Precision("bfloat16")
BF16_STORED = precision_lib.Precision("bfloat16", "bfloat16")


def logits_and_grads(eng, layout, seed=0):
  """(logits, logical gradients as host numpy) of the tiny GPT's seed-`seed` state in `layout`."""
  state = eng.to_padded(eng.init_logical(seed), layout)
  batch = eng.shard_batch(H.make_batch("gpt", seed))
  logits, grads = H.logits_and_grads(eng, state.params, batch, eng.plan(layout))
  logical = eng.to_logical(engine_lib.TrainState(grads, eng.tx.init(grads)), layout).params
  return np.asarray(logits), eng.logical_arrays(logical)


def max_diff(a, b):
  return max(float(np.max(np.abs(np.asarray(x, np.float32) - np.asarray(y, np.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_bfloat16_uneven_split_equals_the_even_split_within_round_off():
  eng = H.make_engine("gpt", 1, 8, precision=BF16)
  even_logits, even_grads = logits_and_grads(eng, H.even_layout(8))
  odd_logits, odd_grads = logits_and_grads(eng, H.random_layout(1, 8))
  f32_logits, f32_grads = logits_and_grads(H.make_engine("gpt", 1, 8), H.even_layout(8))
  assert even_logits.dtype == np.float32 and jax.tree.leaves(even_grads)[0].dtype == np.float32
  # bfloat16 ran (its round-off shows against float32), and the split only reorders sums of
  # bfloat16 partials: the uneven result is within a few bfloat16 steps of the even one.
  bf16_error = np.max(np.abs(even_logits - f32_logits))
  assert 1e-4 < bf16_error < 0.05
  np.testing.assert_allclose(odd_logits, even_logits, atol=0.05, rtol=0.02)
  assert max_diff(odd_grads, even_grads) < 0.05
  assert max_diff(odd_grads, even_grads) < 4 * max_diff(even_grads, f32_grads) + 1e-3


def test_bfloat16_blocks_all_reduce_in_bfloat16_and_keep_float32_weights():
  eng = H.make_engine("gpt", 1, 4, precision=BF16)
  layout = H.random_layout(2, 4)
  state = eng.init(0, layout)
  batch = eng.shard_batch(H.make_batch("gpt"))
  hlo = jax.jit(lambda p, b, pl: eng.loss(p, b, pl)[0]).lower(
      state.params, batch, eng.plan(layout)).as_text()
  reduces = [m.group(1) for m in re.finditer(
      r'"stablehlo.all_reduce".*?\}\) : \(tensor<([^>]*)>\)', hlo, re.S)]
  # Two blocks (attention + MLP) per layer sum their partials over `tensor` in bfloat16; the
  # loss terms are summed over `data` in float32.
  assert sum(r.endswith("bf16") for r in reduces) == 2 * H.GPT_KW["num_layers"], reduces
  assert sum(r.endswith("f32") for r in reduces) == len(reduces) - 2 * H.GPT_KW["num_layers"]
  assert {str(x.dtype) for x in jax.tree.leaves(state)} == {"float32", "int32"}
  f32_bytes = H.make_engine("gpt", 1, 4).unit_bytes()
  assert eng.unit_bytes() == {k: v / 2 for k, v in f32_bytes.items()}


def test_bfloat16_storage_migrates_bit_exactly():
  tx = optax.adamw(1e-2, mu_dtype=jnp.bfloat16)
  eng = H.make_engine("gpt", 1, 4, tx=tx, precision=BF16_STORED)
  logical = eng.init_logical(0)
  assert {str(x.dtype) for x in jax.tree.leaves(logical.params)} == {"bfloat16"}
  a, b = H.random_layout(3, 4), H.random_layout(4, 4)
  state = eng.to_padded(logical, a)
  # A step so that the moments are not zeros, then a round trip a -> b -> a.
  state, _ = eng.train_step(state, eng.shard_batch(H.make_batch("gpt")), eng.plan(a))
  expected = eng.logical_arrays(eng.to_logical(state, a))
  moved = eng.relayout(state, a, b)
  in_b = eng.logical_arrays(eng.to_logical(moved, b))
  got = eng.logical_arrays(eng.to_logical(eng.relayout(moved, b, a), a))
  bits = lambda x: np.atleast_1d(x).view(np.uint8)
  for x, y, z in zip(jax.tree.leaves(got), jax.tree.leaves(in_b), jax.tree.leaves(expected)):
    assert x.dtype == y.dtype == z.dtype
    np.testing.assert_array_equal(bits(x), bits(z))
    np.testing.assert_array_equal(bits(y), bits(z))
  mu = [x for path, x in jax.tree_util.tree_leaves_with_path(got)
        if "mu" in jax.tree_util.keystr(path)]
  assert mu and {str(x.dtype) for x in mu} == {"bfloat16"}


@pytest.mark.parametrize("saved, restored", [(None, BF16_STORED), (BF16_STORED, None)])
def test_a_checkpoint_of_one_precision_restores_into_the_other(tmp_path, saved, restored):
  src = H.make_engine("gpt", 1, 4, precision=saved)
  dst = H.make_engine("gpt", 1, 4, precision=restored)
  logical = src.init_logical(5)
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path))
  ckpt.save(1, logical, {"step": 1})
  got, _ = ckpt.restore(dst.abstract_logical())
  ckpt.close()
  want_dtype = dst.precision.storage
  for x, y in zip(jax.tree.leaves(dst.logical_arrays(got)),
                  jax.tree.leaves(src.logical_arrays(logical))):
    assert x.dtype == (want_dtype if jnp.issubdtype(y.dtype, jnp.floating) else y.dtype)
    # Saved float32 -> bfloat16: rounded once; saved bfloat16 -> float32: exact.
    np.testing.assert_array_equal(x, y.astype(x.dtype))


def test_auto_attention_is_xla_on_cpu_and_the_choice_is_what_runs():
  assert BF16.attention_impl(64) == "xla"
  assert precision_lib.Precision("bfloat16", attention="cudnn").attention_impl(64) == "cudnn"
  assert precision_lib.Precision(attention="xla").attention_impl(4) == "xla"


def test_a_float32_run_resumes_in_bfloat16_storage(tmp_path, capsys):
  config = H.tiny_gpt(steps=3)
  train.train_and_evaluate(config, str(tmp_path))
  config = H.tiny_gpt(steps=6)
  config.model.update(dtype="bfloat16", param_dtype="bfloat16")
  summary = train.train_and_evaluate(config, str(tmp_path))
  out = capsys.readouterr().out
  assert "parameters stored in float32, restored into bfloat16" in out
  assert summary["start_step"] == 3 and np.isfinite(summary["val/loss"])
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "checkpoints"))
  assert ckpt.latest_step() == 6 and ckpt.read_meta()["param_dtypes"] == ["bfloat16"]
  ckpt.close()
