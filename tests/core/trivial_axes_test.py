"""A tensor axis of one device costs no collective: the compiled steps of such a mesh lower with
its size-1 axes left out of the arrays' types (`mesh.lowering_scope`), so a tensor psum (or a
data psum with one replica) is no op, not an all-reduce over one device that XLA keeps."""

import jax
import numpy as np
import optax
import pytest

import dense_reference as dense_ref
import helpers as H
from benchmarks.hlo import all_reduce_group_sizes
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline
from semijax.models import gpt, tasks


def test_group_sizes_are_read_from_both_forms_of_hlo():
  hlo = ("  %a = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=1, replica_groups={{0},{1}}, "
         "use_global_device_ids=true, to_apply=%sum\n"
         "  %b = f32[4]{0} all-reduce-start(f32[4]{0} %y), replica_groups=[2,4]<=[8], to_apply=%s\n"
         "  %c = f32[4]{0} add(f32[4]{0} %a, f32[4]{0} %b)\n")
  assert all_reduce_group_sizes(hlo) == [1, 4]
  with pytest.raises(ValueError, match="without replica groups"):
    all_reduce_group_sizes("  %d = f32[4]{0} all-reduce(f32[4]{0} %x), to_apply=%sum")


def compiled_train_hlo(data, tensor):
  eng = H.make_engine("gpt", data, tensor)
  lay = H.even_layout(tensor)
  state = eng.init(0, lay)
  batch = eng.shard_batch(H.make_batch("gpt"))
  plan = eng.plan(lay)
  step = eng.programs.compiled_fn("train", state, batch, plan)
  return eng, state, batch, plan, step


@pytest.mark.parametrize("data,tensor", [(1, 1), (2, 1), (2, 4)])
def test_no_all_reduce_runs_over_a_single_device(data, tensor):
  *_, step = compiled_train_hlo(data, tensor)
  sizes = all_reduce_group_sizes(step.as_text())
  assert all(s != 1 for s in sizes), sizes
  if data == tensor == 1:
    assert sizes == []
  else:   # the axes of size > 1 keep their all-reduces: the loss and gradients need them
    assert sizes


def test_a_tensor_axis_of_several_devices_lowers_as_before():
  # There the scope is not used (see `mesh.lowering_scope`): the one-replica data axis keeps its
  # all-reduce of the gradients.
  *_, step = compiled_train_hlo(1, 2)
  assert 1 in all_reduce_group_sizes(step.as_text())


def test_without_the_scope_a_tensor_1_step_has_single_device_all_reduces():
  # What the scope removes, so that the test above could fail: the same step lowered without it.
  eng, state, batch, plan, _ = compiled_train_hlo(1, 1)
  lowered = jax.jit(eng.programs.train_step_fn).lower(state, batch, plan)
  assert 1 in all_reduce_group_sizes(lowered.compile().as_text())


def test_a_tensor_1_step_without_collectives_trains_like_the_dense_reference():
  eng, _, batch, plan, step = compiled_train_hlo(1, 1)
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, H.even_layout(1))
  logical = eng.logical_arrays(logical).params
  _, ref_params, loss = H.reference_loss_fn("gpt", logical)
  want = float(loss(ref_params, H.make_batch("gpt"))[0])
  _, metrics = step(state, batch, plan)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=2e-6)


def test_the_scope_drops_only_size_1_axes():
  mesh = mesh_lib.make_mesh(2, 1)
  def f(x):
    return jax.lax.psum(x, mesh_lib.AXES)
  fn = jax.shard_map(f, mesh=mesh, in_specs=jax.sharding.PartitionSpec(mesh_lib.AXES),
                     out_specs=jax.sharding.PartitionSpec())
  x = np.arange(4.0, dtype=np.float32)
  with mesh_lib.lowering_scope(mesh):
    compiled = jax.jit(fn).lower(x).compile()
  assert all_reduce_group_sizes(compiled.as_text()) == [2]
  np.testing.assert_allclose(compiled(x), x[:2] + x[2:])



def test_a_pipelined_tensor_1_step_has_no_all_reduce_over_one_device_and_the_dense_loss():
  kw = dict(H.GPT_KW, num_layers=4)
  eng = pipeline.PipelineEngine(lambda rngs: gpt.GPT(rngs=rngs, **kw), tasks.language_model,
                                mesh_lib.make_pipeline_mesh(1, 2, 1), optax.sgd(0.1),
                                schedule="1f1b", microbatches=2)
  one = L.Layout.for_model(d_model=kw["d_model"], num_heads=kw["num_heads"], d_ff=kw["d_ff"],
                           num_devices=1)
  layout = pipeline.PipeLayout.build(4, (1, 3), (one, one), capacity=3)
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, layout)
  batch = H.make_batch("gpt", 0, batch_size=4)
  arranged, pplan = eng.arrange_batch(batch, (2,)), eng.plan(layout, (2,))
  step = eng.programs.compiled("train", state, arranged, pplan)
  sizes = all_reduce_group_sizes(step.as_text())
  assert 1 not in sizes and -1 not in sizes, sizes   # the one psum left is over `pipe`: 2
  _, metrics = step(state, arranged, pplan)
  graphdef, ref_params = dense_ref.build(dense_ref.GPT, eng.logical_arrays(logical), **kw)
  logp = jax.nn.log_softmax(dense_ref.apply(graphdef, ref_params, batch["inputs"]))
  want = -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
