"""The Llama in the pipelined engine (core.pipeline) against the independent dense reference.

4 layers on (data, pipe, tensor) meshes of the 8 fake devices: uneven layers per stage and an
uneven KV-group layout of its own in every stage (a device owning no group), both schedules,
tied and untied embeddings (the tied table is used by the first stage's stem and the last
stage's head). Loss and every gradient must equal the dense model's, and padding gets none.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers as H
import llama_reference as ref
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline
from semijax.core import precision as precision_lib
from semijax.models import llama
from semijax.models import tasks

KW = dict(vocab_size=64, seq_len=8, d_model=32, num_heads=8, num_kv_heads=4, d_ff=48,
          num_layers=4)
ATOL = 2e-5


def units(mlp, heads):
  """A 2-device tensor layout inside a stage (shared capacities and widths, the width 0 among
  them, so stages share a bucket)."""
  return L.Layout(mlp=L.UnitLayout.from_counts("mlp", mlp, capacity=38, widths=(19, 38)),
                  heads=L.UnitLayout.from_counts("heads", heads, capacity=4, widths=(0, 2, 4)))


UNEVEN = (units((30, 18), (3, 1)), units((10, 38), (0, 4)))


def batch(seed, batch_size):
  rng = np.random.default_rng(seed)
  toks = rng.integers(0, KW["vocab_size"], (batch_size, KW["seq_len"] + 1)).astype(np.int32)
  return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}


@pytest.mark.parametrize("schedule,data,stage_layers,microbatches,tie,remat", [
    ("1f1b", 2, (1, 3), (3, 1), False, "none"),
    ("gpipe", 1, (3, 1), (2,), True, "full"),      # blocks rematerialized (core.remat)
    ("1f1b", 1, (1, 1, 1, 1), (2,), True, "none"),
])
def test_loss_and_gradients_match_the_dense_reference(schedule, data, stage_layers,
                                                       microbatches, tie, remat):
  kw = dict(KW, tie_embeddings=tie, precision=precision_lib.Precision(remat_policy=remat))
  stages = len(stage_layers)
  mesh = mesh_lib.make_pipeline_mesh(data, stages, 2)
  eng = pipeline.PipelineEngine(lambda rngs: llama.Llama(rngs=rngs, **kw), tasks.language_model,
                                mesh, optax.sgd(0.1), schedule=schedule,
                                microbatches=max(microbatches))
  assert eng.unit_sizes == {"mlp": 1, "heads": 1}
  layout = pipeline.PipeLayout.build(KW["num_layers"], stage_layers, (UNEVEN * stages)[:stages],
                                     capacity=max(stage_layers))
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, layout)
  b = batch(0, 2 * sum(microbatches))
  grads, terms = jax.jit(eng.grads_and_terms)(state.params, eng.arrange_batch(b, microbatches),
                                              eng.plan(layout, microbatches))
  params = jax.tree.map(jnp.asarray, eng.logical_arrays(logical))
  (want_loss, _), want_grads = jax.value_and_grad(ref.loss, has_aux=True)(
      params, jax.tree.map(jnp.asarray, b), KW["num_heads"])
  np.testing.assert_allclose(float(terms["loss_sum"] / terms["count"]), float(want_loss),
                             rtol=1e-5)
  got = eng.logical_arrays(eng.to_logical(grads, layout))
  H.assert_trees_close(got, want_grads, atol=ATOL)
  if tie:
    assert "head" not in got
