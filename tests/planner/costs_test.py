"""The planner's model costs against the real models' parameters and the spec's FLOPs."""

import jax
import numpy as np
import pytest
from flax import nnx

from helpers import GPT_KW, VIT_KW
from semijax import models
from semijax.planner import costs as costs_lib


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


def test_unit_ms_follows_the_spec_flops():
  spec = models.spec("gpt", GPT_KW)
  costs = costs_lib.ModelCosts.from_spec(spec, 4.0)
  flops = spec.flops_per_unit()
  ms = costs.unit_ms(tokens=64)
  for k in ("mlp", "heads"):
    assert ms[k] == pytest.approx(flops[k] * 64 / 4e9 * 1e3)
    assert costs.unit_s(64)[k] == pytest.approx(ms[k] / 1e3)
  assert costs.activation_bytes(64) == 64 * spec.d_model * 4
  with pytest.raises(ValueError, match="device_gflops"):
    costs_lib.ModelCosts.from_spec(spec, 0.0)
