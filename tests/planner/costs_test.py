"""The planner's model costs against the real models' parameters, dtypes and optimizer state and
the spec's FLOPs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from helpers import GPT_KW, VIT_KW
from semijax import models
from semijax.planner import costs as costs_lib
from semijax.train import optimizer as optimizer_lib


def count_params(module):
  return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nnx.state(module,
                                                                                 nnx.Param)))


@pytest.mark.parametrize("name,kw", [("gpt", GPT_KW), ("vit", VIT_KW)])
def test_parameter_counts_match_the_models(name, kw):
  spec = models.spec(name, kw)
  costs = costs_lib.ModelCosts.from_spec(spec, 2.0)
  make, _ = models.build(spec)
  model = make(nnx.Rngs(0))
  per_layer = costs.layer_params + sum(costs.unit_params[k] * u
                                       for k, u in costs.num_units.items())
  total = costs.first_params + costs.last_params + spec.num_layers * per_layer
  assert total == count_params(model)
  # The layer's share alone: one block's parameters.
  assert per_layer == count_params(model.encoder.blocks[0])


def test_unit_ms_is_the_forward_flops_counted_by_hand():
  # d_model 32, 8 heads of 4, seq_len 8, causal. Forward FLOPs a token: an MLP unit 2 GEMMs x 2 x
  # 32 = 128; a head 4 GEMMs x 2 x 32 x 4 = 1024 plus scores and values 2 x 2 x 8 x 4 / 2 = 64.
  # 64 tokens at 4 GFLOP/s: 128 x 64 / 4e9 s = 2.048 us, 1088 x 64 / 4e9 s = 17.408 us.
  spec = models.spec("gpt", GPT_KW)
  costs = costs_lib.ModelCosts.from_spec(spec, 4.0)
  assert costs.unit_ms(tokens=64) == pytest.approx({"mlp": 2.048e-3, "heads": 17.408e-3})
  assert costs.unit_s(64) == pytest.approx({"mlp": 2.048e-6, "heads": 17.408e-6})
  assert costs.activation_bytes(64) == 64 * 32 * 4                  # float32 [64, d_model]
  with pytest.raises(ValueError, match="device_gflops"):
    costs_lib.ModelCosts.from_spec(spec, 0.0)


def _xla_flops_per_token(fn, x, tokens):
  cost = jax.jit(fn).lower(x).compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  return cost["flops"] / tokens


def test_edge_flops_follow_xla_s_count():
  """The unsplit work outside the blocks (`ModelSpec.edge_flops`) against XLA's FLOP count of
  the model's own code: a GPT's final norm and head (a vocabulary large enough for the head's
  GEMM to matter; the loss's 5 vocab is not part of `head_out`), a ViT's patch embedding."""
  spec = models.spec("gpt", dict(GPT_KW, vocab_size=256))
  costs = costs_lib.ModelCosts.from_spec(spec, 1.0)
  model = models.build(spec)[0](nnx.Rngs(0))
  x = jnp.zeros((2, spec.seq_len, spec.d_model))
  xla = _xla_flops_per_token(model.head_out, x, 2 * spec.seq_len)
  assert xla == pytest.approx(costs.last_flops - 5 * 256, rel=0.05)
  spec = models.spec("vit", VIT_KW)
  costs = costs_lib.ModelCosts.from_spec(spec, 1.0)
  model = models.build(spec)[0](nnx.Rngs(0))
  images = jnp.zeros((2, VIT_KW["image_size"], VIT_KW["image_size"], VIT_KW["channels"]))
  xla = _xla_flops_per_token(model.stem, images, 2 * spec.seq_len)
  assert xla == pytest.approx(costs.first_flops, rel=0.05)
  # Charged to the edge stages, once each; one stage runs both.
  np.testing.assert_allclose(costs.edge_s(100, 3), [costs.first_flops * 100 / 1e9, 0,
                                                    costs.last_flops * 100 / 1e9])
  assert costs.edge_s(100, 1)[0] == pytest.approx((costs.first_flops + costs.last_flops) / 1e7)


@pytest.mark.parametrize("dtype, param_dtype, mu_dtype", [
    ("float32", "float32", ""), ("bfloat16", "float32", ""), ("bfloat16", "float32", "bfloat16"),
    ("bfloat16", "bfloat16", "float32"), ("float16", "bfloat16", "")])
def test_bytes_per_value_are_the_models_and_the_optimizers(dtype, param_dtype, mu_dtype):
  """`StateBytes` against the real model and optimizer: what the model stores per parameter,
  what its stem hands the first block (an activation, as a stage boundary and a tensor
  all-reduce carry it), and what AdamW keeps of each moment."""
  spec = models.spec("gpt", dict(GPT_KW, dtype=dtype, param_dtype=param_dtype))
  costs = costs_lib.ModelCosts.from_spec(spec, 1.0, mu_dtype)
  nbytes = costs.nbytes
  model = models.build(spec)[0](nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  leaves = jax.tree.leaves(params)
  count = sum(x.size for x in leaves)
  assert sum(x.nbytes for x in leaves) == nbytes.param * count
  act = jax.eval_shape(model.stem, jnp.zeros((2, spec.seq_len), jnp.int32))
  assert act.dtype.itemsize == nbytes.compute
  assert costs.activation_bytes(64) == 64 * 32 * act.dtype.itemsize
  tx = optimizer_lib.make(optimizer_lib.OptimizerSpec(mu_dtype=mu_dtype), 10)
  adam = [s for s in jax.tree.leaves(jax.eval_shape(tx.init, params),
                                     is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)]
  assert len(adam) == 1
  moment_bytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))
  assert moment_bytes(adam[0].mu) == nbytes.mu * count
  assert moment_bytes(adam[0].nu) == nbytes.nu * count
  assert nbytes.state == nbytes.param + nbytes.mu + nbytes.nu
  # Gradients arrive in the parameters' dtype.
  assert nbytes.grad == nbytes.param


def test_a_half_compute_dtype_halves_the_activation_bytes_only():
  f32 = costs_lib.ModelCosts.from_spec(models.spec("gpt", GPT_KW), 1.0)
  bf16 = costs_lib.ModelCosts.from_spec(models.spec("gpt", dict(GPT_KW, dtype="bfloat16")), 1.0)
  assert f32.nbytes == costs_lib.StateBytes()                        # 4 bytes everywhere
  assert bf16.activation_bytes(64) == f32.activation_bytes(64) / 2
  assert bf16.nbytes.state == f32.nbytes.state == 12
  stored = costs_lib.ModelCosts.from_spec(
      models.spec("gpt", dict(GPT_KW, param_dtype="bfloat16")), 1.0, "float32")
  assert stored.activation_bytes(64) == f32.activation_bytes(64)
  assert (stored.nbytes.param, stored.nbytes.grad, stored.nbytes.state) == (2, 2, 8)
  with pytest.raises(ValueError, match="mu_dtype: 'int8'"):
    costs_lib.StateBytes.of(mu_dtype="int8")
  with pytest.raises(ValueError, match="StateBytes.compute"):
    costs_lib.StateBytes(compute=0)
