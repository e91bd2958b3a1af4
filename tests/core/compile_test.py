"""Changing owned counts or active widths inside a capacity bucket never recompiles."""

import jax
import pytest

import helpers as H
from semijax.core import layout as L


def layout(mlp, heads, cap_mlp=16, cap_heads=3):
  kw = H.GPT_KW
  return L.Layout.for_model(d_model=kw["d_model"], num_heads=kw["num_heads"], d_ff=kw["d_ff"],
                            num_devices=4, mlp=mlp, heads=heads,
                            capacity={"mlp": cap_mlp, "heads": cap_heads})


def test_counts_and_actives_inside_a_bucket_reuse_the_compiled_step():
  eng = H.make_engine("gpt", 2, 4)
  even = layout((12, 12, 12, 12), (2, 2, 2, 2))
  uneven = layout((16, 2, 15, 15), (3, 1, 2, 2))
  resized = uneven.replace(mlp=uneven.mlp.with_active((5, 1, 15, 9)),
                           heads=uneven.heads.with_active((1, 0, 2, 1)))
  assert even.bucket() == uneven.bucket() == resized.bucket()
  batch = eng.shard_batch(H.make_batch("gpt"))
  state = eng.init(0, even)
  eng.compile(state, batch, eng.plan(even))            # ahead of time, once per bucket
  state = eng.relayout(state, even, even, chunk=None)  # warm the (data-driven) repacking too
  traces, compiles = eng.trace_count, eng.compile_count

  with H.count_backend_compiles() as events:
    prev = even
    for lay in (uneven, resized, even, resized):
      state = eng.relayout(state, prev, lay, chunk=None)
      plan = eng.plan(lay)
      state, metrics = eng.train_step(state, batch, plan)
      eng.eval_terms(state.params, batch, plan)
      prev = lay
    jax.block_until_ready(metrics)
  assert events == []
  assert (eng.trace_count, eng.compile_count) == (traces, compiles)

  # A new capacity bucket is a new compiled variant, exactly once.
  bigger = layout((20, 4, 12, 12), (2, 2, 2, 2), cap_mlp=20)
  state = eng.relayout(state, prev, bigger)
  with H.count_backend_compiles() as events:
    for _ in range(2):
      state, metrics = eng.train_step(state, batch, eng.plan(bigger))
  assert eng.compile_count == compiles + 1 and len(events) >= 1


def test_strict_engine_refuses_an_unknown_bucket_before_compiling():
  eng = H.make_engine("gpt", 1, 4, strict=True)
  lay = layout((12, 12, 12, 12), (2, 2, 2, 2))
  state = eng.init(0, lay)
  batch = eng.shard_batch(H.make_batch("gpt"))
  with H.count_backend_compiles() as events:
    with pytest.raises(L.LayoutError, match=r"^layout.capacity: no compiled train step"):
      eng.train_step(state, batch, eng.plan(lay))
  assert events == [] and eng.compile_count == 0


def test_layout_that_does_not_fit_the_model_is_refused():
  eng = H.make_engine("gpt", 1, 4)
  with pytest.raises(L.LayoutError, match=r"^layout: 8 devices, but mesh.tensor = 4"):
    eng.plan(H.even_layout(8))
  wrong = L.Layout.for_model(d_model=32, num_heads=8, d_ff=40, num_devices=4)
  with pytest.raises(L.LayoutError, match=r"^layout.mlp: 40 units, but the model has 48"):
    eng.init(0, wrong)
