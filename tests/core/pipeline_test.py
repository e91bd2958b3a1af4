"""Pipelined training (core.pipeline) against the dense reference and the unpipelined engine.

A GPT of 4 layers on (data, pipe, tensor) meshes of the 8 fake devices: uneven layers per stage,
an uneven tensor layout of its own in every stage, data-parallel pipelines running unequal
numbers of microbatches, both schedules. Loss and every gradient must equal the single-device
dense model's; training must follow the unpipelined engine step for step; moving layers between
stages with the migration collective must equal a re-layout through the logical form bit for
bit; a boundary moved inside the compiled layer capacity must compile nothing, and so must every
move between layouts of one bucket once `compile_moves` has run.
"""

import jax
import numpy as np
import optax
import pytest

import dense_reference as ref
import helpers as H
from semijax.core import engine as engine_lib
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline
from semijax.errors import LayoutError
from semijax.models import gpt, tasks
from semijax.train import optimizer as optimizer_lib

KW = dict(H.GPT_KW, num_layers=4)
D_MODEL, HEADS, D_FF = KW["d_model"], KW["num_heads"], KW["d_ff"]
ATOL = 2e-5


def model_fn(rngs):
  return gpt.GPT(rngs=rngs, **KW)


def units(mlp, heads, capacity=(38, 6)):
  """A 2-device tensor layout inside a stage (shared capacity, so stages share a bucket)."""
  return L.Layout.for_model(d_model=D_MODEL, num_heads=HEADS, d_ff=D_FF, num_devices=2, mlp=mlp,
                            heads=heads, capacity={"mlp": capacity[0], "heads": capacity[1]})


UNEVEN = (units((30, 18), (5, 3)), units((10, 38), (2, 6)))


def make(data, stages, schedule="1f1b", microbatches=1, tx=None):
  mesh = mesh_lib.make_pipeline_mesh(data, stages, 2)
  return pipeline.PipelineEngine(model_fn, tasks.language_model, mesh, tx or optax.sgd(0.1),
                                 schedule=schedule, microbatches=microbatches)


def stage_layout(stage_layers, capacity=3):
  stages = len(stage_layers)
  return pipeline.PipeLayout.build(KW["num_layers"], stage_layers,
                                   (UNEVEN * stages)[:stages], capacity=capacity)


def unit_padding(eng, stacked_tree, layout):
  """Every entry of `stacked_tree` that no stage owns (padded layers and padded unit slots)."""
  rows = layout.layers.owned_mask()
  out = []
  for a, x in zip(jax.tree.leaves(eng.block_axes), jax.tree.leaves(stacked_tree)):
    x = np.asarray(x)
    out.append(x[~rows].ravel())
    if (unit := a.unit()) is not None:
      axis, kind = unit
      size = eng.unit_sizes[kind]
      per_stage = x.reshape((layout.stages, -1) + x.shape[1:])
      for s, u in enumerate(layout.units):
        mask = np.repeat(u.kinds()[kind].owned_mask(), size)
        out.append(np.moveaxis(per_stage[s], axis + 1, 0)[~mask].ravel())
  return np.concatenate(out)


@pytest.mark.parametrize("schedule,data,stage_layers,microbatches", [
    ("1f1b", 2, (1, 3), (3, 1)),
    ("gpipe", 2, (3, 1), (2, 2)),
    ("1f1b", 1, (1, 1, 1, 1), (2,)),
])
def test_loss_and_gradients_match_dense_reference(schedule, data, stage_layers, microbatches):
  eng = make(data, len(stage_layers), schedule, max(microbatches))
  layout = stage_layout(stage_layers, capacity=max(stage_layers))
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, layout)
  batch = H.make_batch("gpt", 0, batch_size=2 * sum(microbatches))
  grads, terms = jax.jit(eng.grads_and_terms)(state.params, eng.arrange_batch(batch, microbatches),
                                              eng.plan(layout, microbatches))
  graphdef, ref_params = ref.build(ref.GPT, eng.logical_arrays(logical), **KW)

  def ref_loss(p):
    logp = jax.nn.log_softmax(ref.apply(graphdef, p, batch["inputs"]))
    return -np.take_along_axis(logp, batch["targets"][..., None], -1).mean()
  want_loss, want_grads = jax.value_and_grad(ref_loss)(ref_params)
  np.testing.assert_allclose(float(terms["loss_sum"] / terms["count"]), float(want_loss),
                             rtol=1e-5)
  assert float(terms["count"]) == batch["targets"].size
  assert not np.any(unit_padding(eng, grads[pipeline.STACK], layout))
  got = eng.logical_arrays(eng.to_logical(grads, layout))
  H.assert_trees_close(got, ref.from_reference(want_grads), atol=ATOL)


def test_training_follows_the_unpipelined_engine():
  # AdamW with weight decay on matrices only: a stacked [layers, d] bias must not be decayed.
  spec = optimizer_lib.OptimizerSpec(learning_rate=1e-2, warmup_steps=1, weight_decay=0.1)
  tx = optimizer_lib.make(spec, steps=4)
  eng = make(2, 2, "1f1b", microbatches=2, tx=tx)
  layout = stage_layout((1, 3))
  flat = engine_lib.Engine(model_fn, tasks.language_model, mesh_lib.make_mesh(1, 2), tx)
  flat_layout = H.even_layout(2)
  state = eng.to_padded(eng.init_logical(0), layout)
  flat_state = flat.to_padded(flat.init_logical(0), flat_layout)
  pplan, fplan = eng.plan(layout, (2, 2)), flat.plan(flat_layout)
  for step in range(3):
    batch = H.make_batch("gpt", step, batch_size=8)
    state, metrics = eng.train_step(state, eng.arrange_batch(batch, (2, 2)), pplan)
    flat_state, flat_metrics = flat.train_step(flat_state, flat.shard_batch(batch), fplan)
    np.testing.assert_allclose(float(metrics["loss"]), float(flat_metrics["loss"]), rtol=1e-5)
  got = eng.logical_arrays(eng.to_logical(state, layout))
  want = flat.logical_arrays(flat.to_logical(flat_state, flat_layout).params)
  for i in range(KW["num_layers"]):
    # Softmax ignores a key bias: its gradient is rounding noise, which Adam scales to full steps.
    for tree in (got, want):
      del tree["encoder"]["blocks"][i]["attn"]["bk"]
  H.assert_trees_close(got, want, atol=1e-5)
  # Unstacked onto the unpipelined form (through a one-stage engine, as a resume does), the
  # whole state is the unpipelined engine's: parameters, Adam's moments and step counts.
  one = pipeline.PipelineEngine(model_fn, tasks.language_model,
                                mesh_lib.make_pipeline_mesh(1, 1, 2), tx)
  got = one.unstacked(eng.to_logical(state, layout), flat.logical_shardings())
  want = flat.to_logical(flat_state, flat_layout)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  no_bk = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, x: 0 * x if "'bk'" in jax.tree_util.keystr(path) else x, tree)
  H.assert_trees_close(no_bk(flat.logical_arrays(got)), no_bk(flat.logical_arrays(want)),
                       atol=1e-5)
  # ... and back: the unpipelined state with each block put on its own stage's devices (as a
  # pipelined run restores an unpipelined checkpoint), stacked, is the pipelined logical state.
  abstract = eng.flat_abstract()
  assert [jax.tree.leaves(abstract.params["encoder"]["blocks"][l])[0].sharding.mesh.devices.tolist()
          for l in range(4)] == (
      [eng.mesh.devices[:, 0, :].tolist()] * 2 + [eng.mesh.devices[:, 1, :].tolist()] * 2)
  placed = jax.device_put(want, jax.tree.map(lambda x: x.sharding, abstract))
  blocks = jax.tree.leaves(placed.params["encoder"]["blocks"])
  back = eng.stacked(placed, donate=True)
  assert all(x.is_deleted() for x in blocks)          # freed as they were stacked
  logical = eng.to_logical(state, layout)
  assert jax.tree.structure(back) == jax.tree.structure(logical)
  for b, x in zip(jax.tree.leaves(back), jax.tree.leaves(logical)):
    assert b.sharding == x.sharding and b.dtype == x.dtype
  H.assert_trees_close(no_bk(back), no_bk(logical), atol=1e-5)


def test_layer_move_equals_relayout_bit_for_bit():
  # Layers 1-2 change stage and every stage changes its tensor layout, weights and Adam moments.
  eng = make(2, 2, tx=optax.adam(1e-2))
  old = stage_layout((1, 3))
  new = pipeline.PipeLayout.build(4, (3, 1), UNEVEN[::-1], capacity=3)
  logical = eng.init_logical(0)
  state = eng.to_padded(logical, old)
  state = eng.train_step(state, eng.arrange_batch(H.make_batch("gpt", 1, 4), (1, 1)),
                         eng.plan(old))[0]
  want = eng.to_padded(eng.to_logical(state, old), new)
  moved = eng.move(state, old, new)
  for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
  assert not np.any(unit_padding(eng, moved.params[pipeline.STACK], new))
  back = eng.logical_arrays(eng.to_logical(moved, new))
  H.assert_trees_close(back, eng.logical_arrays(eng.to_logical(state, old)), atol=0, rtol=0)


def test_boundary_move_inside_the_capacity_compiles_nothing():
  """The moved state's step under the new boundary compiles nothing and is the step the state
  takes under the old one: the same loss and the same parameters."""
  eng = make(1, 2, microbatches=2)
  first, second = stage_layout((1, 3)), stage_layout((2, 2))
  assert first.bucket() == second.bucket()
  state = eng.to_padded(eng.init_logical(0), first)
  batch = eng.arrange_batch(H.make_batch("gpt", 0, 4), (2,))
  state, _ = eng.train_step(state, batch, eng.plan(first))
  compiled = eng.compile_count
  stay, want = eng.train_step(jax.tree.map(lambda x: x.copy(), state), batch, eng.plan(first))
  state = eng.move(state, first, second, donate=True)
  with H.count_backend_compiles() as events:
    state, metrics = eng.train_step(state, batch, eng.plan(second))
  assert eng.compile_count == compiled and not events
  np.testing.assert_allclose(float(metrics["loss"]), float(want["loss"]), rtol=1e-6)
  H.assert_trees_close(eng.logical_arrays(eng.to_logical(state, second)),
                       eng.logical_arrays(eng.to_logical(stay, first)), atol=1e-6)


def test_compiled_moves_cover_every_move_inside_the_bucket():
  """After `compile_moves`, moves between layouts of one bucket (layers and units, units only,
  one kind only, one unit) compile nothing, and each equals the re-layout through the logical
  form bit for bit."""
  eng = make(1, 2, tx=optax.adam(1e-2))
  start = stage_layout((2, 2))
  one_unit = (units((31, 17), (5, 3)), UNEVEN[1])
  chain = [start,
           pipeline.PipeLayout.build(4, (1, 3), UNEVEN[::-1], capacity=3),      # layers, units
           pipeline.PipeLayout.build(4, (1, 3), one_unit, capacity=3),          # one MLP unit
           pipeline.PipeLayout.build(4, (3, 1), one_unit, capacity=3),          # layers only
           start]
  state = eng.to_padded(eng.init_logical(0), start)
  wants = [eng.to_padded(eng.to_logical(state, start), layout) for layout in chain[1:]]
  assert eng.compile_moves(state, start) > 0
  assert eng.compile_moves(state, chain[1]) == 0            # the same bucket: all compiled
  with H.count_backend_compiles() as events:
    moved = []
    for old, new in zip(chain, chain[1:]):
      state = eng.move(state, old, new, donate=True)
      moved.append(jax.device_get(state))
  assert not events
  for got, want in zip(moved, wants):
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_layouts_and_microbatches_are_named():
  eng = make(2, 2, microbatches=2)
  with pytest.raises(LayoutError, match="pipeline.layers"):
    pipeline.PipeLayout.build(4, (1, 2), UNEVEN)
  with pytest.raises(LayoutError, match="pipeline.layers"):
    pipeline.PipeLayout.build(4, (4, 0), UNEVEN)
  with pytest.raises(LayoutError, match="mesh.pipe"):
    eng.check_layout(pipeline.PipeLayout.build(4, (1, 1, 2), UNEVEN + UNEVEN[:1]))
  with pytest.raises(ValueError, match="pipeline.microbatches"):
    eng.plan(stage_layout((1, 3)), (3, 1))


def test_per_pipeline_gradients_are_each_pipelines_own():
  """`replica_grads_and_terms` (the replica modes' gradients): pipeline d, on its own
  parameters, gives the gradient of the mean loss over its own rows only; with the same
  parameters everywhere their token-weighted sum is the synchronous step's gradient."""
  eng = make(2, 2, microbatches=2)
  layout = stage_layout((1, 3))
  state = eng.to_padded(eng.init_logical(0), layout)
  other = eng.to_padded(eng.init_logical(1), layout)
  pplan = eng.plan(layout)
  rows = H.make_batch("gpt", 0, 8)
  batch = eng.shard_batch(rows)
  grads, terms = jax.jit(eng.grads_and_terms)(state.params, batch, pplan)
  stacked = jax.tree.map(lambda a, b: np.stack([np.asarray(a), np.asarray(b)]), state.params,
                         other.params)
  rep, rep_terms = jax.jit(eng.replica_grads_and_terms)(stacked, batch, pplan)
  count = np.asarray(rep_terms["count"])
  assert count.shape == (2,) and count.sum() == float(terms["count"])
  # Pipeline 0 ran on `state`: its gradient is the step's on its half of the batch alone.
  half = eng.shard_batch(jax.tree.map(lambda x: np.concatenate([x[:4], x[:4]]), rows))
  own, _ = jax.jit(eng.grads_and_terms)(state.params, half, pplan)
  H.assert_trees_close(jax.tree.map(lambda x: x[0], rep), own, atol=ATOL)
  # Same parameters on both: the token-weighted sum is the global gradient.
  same = jax.tree.map(lambda a: np.stack([np.asarray(a)] * 2), state.params)
  rep, rep_terms = jax.jit(eng.replica_grads_and_terms)(same, batch, pplan)
  w = np.asarray(rep_terms["count"]) / float(terms["count"])
  H.assert_trees_close(jax.tree.map(lambda x: w[0] * x[0] + w[1] * x[1], rep), grads, atol=ATOL)
  assert not np.allclose(np.asarray(rep_terms["loss_sum"])[0] / count[0],
                         np.asarray(rep_terms["loss_sum"])[1] / count[1])
