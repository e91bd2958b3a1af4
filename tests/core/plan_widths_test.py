"""The single-width step of an even split, and warm-up runs of every branch of a compiled step.

An even split inside a larger capacity bucket executes one width on every device; its exact step
can then be compiled with that width alone (no `lax.switch`, no rematerialization) and must give
the same logits and gradients as the branched step, compared here against the dense reference.
"""

import types

import jax
import numpy as np
import pytest

import helpers
from semijax.balance import warmup as warmup_lib
from semijax.core import kernels
from semijax.core import layout as layout_lib
from semijax.core import plan as plan_lib

N = 4


def bucketed_even():
  """The even split of the test GPT in a bucket twice the even share, four widths per kind."""
  even = helpers.even_layout(N)
  return layout_lib.Layout(**{k: u.replace(capacity=2 * u.capacity,
                                           widths=layout_lib.default_widths(2 * u.capacity, 4))
                              for k, u in even.kinds().items()})


def test_uniform_widths_of_even_and_uneven_layouts():
  layout = bucketed_even()
  mlp = layout.kinds()["mlp"]
  assert len(mlp.widths) == 4 and mlp.capacity > max(mlp.counts)
  narrow = plan_lib.uniform_widths(layout)
  assert narrow == {k: (u.executed_widths()[0],) for k, u in layout.kinds().items()}
  assert plan_lib.uniform_widths(helpers.random_layout(0, N)) is None


def test_single_width_step_matches_branched_step_and_dense_reference():
  eng = helpers.make_engine("gpt", tensor=N)
  layout = bucketed_even()
  state = eng.init(0, layout)
  batch = eng.shard_batch(helpers.make_batch("gpt"))
  narrow = eng.plan(layout, widths=plan_lib.uniform_widths(layout))
  full = eng.plan(layout)
  assert dict(narrow.widths)["mlp"] == (12,) and len(dict(full.widths)["mlp"]) == 4
  got_logits, got_grads = helpers.logits_and_grads(eng, state.params, batch, narrow)
  want_logits, want_grads = helpers.logits_and_grads(eng, state.params, batch, full)
  helpers.assert_trees_close(got_logits, want_logits, atol=1e-5)
  helpers.assert_trees_close(got_grads, want_grads, atol=1e-5)
  logical = jax.device_get(eng.to_logical(state, layout).params)
  ref_logits, _ = helpers.reference_logits_and_grads("gpt", logical, helpers.make_batch("gpt"))
  np.testing.assert_allclose(np.asarray(got_logits), np.asarray(ref_logits), atol=1e-4)
  # The narrow program has no conditional; the branched one does.
  hlo = lambda plan: jax.jit(lambda p, b, pl: eng.loss(p, b, pl)[0]).lower(
      state.params, batch, plan).as_text()
  assert "stablehlo.case" not in hlo(narrow) and "stablehlo.case" in hlo(full)


def test_narrow_widths_must_cover_every_active_count():
  eng = helpers.make_engine("gpt", tensor=N)
  layout = bucketed_even()
  with pytest.raises(ValueError, match="widths.mlp"):
    eng.plan(layout, widths={"mlp": (4,), "heads": (2,)})     # the devices own 12 mlp units
  with pytest.raises(ValueError, match="widths.mlp"):
    eng.plan(layout, widths={"mlp": (64,)})                    # beyond the capacity


def test_branch_plans_take_every_branch_and_exercise_leaves_the_state():
  eng = helpers.make_engine("gpt", tensor=N)
  layout = bucketed_even()
  state = eng.init(0, layout)
  batch = eng.shard_batch(helpers.make_batch("gpt"))
  plan = eng.plan(layout)
  widths = dict(plan.widths)
  plans = plan_lib.branch_plans(plan, eng.mesh)
  taken = {k: sorted({int(kernels.bucket_index(np.asarray(p.active[k])[0], widths[k]))
                      for p in plans}) for k in widths}
  assert taken == {k: list(range(len(w))) for k, w in widths.items()}
  before = jax.device_get(state)
  eng.exercise(state, batch, plan)
  helpers.assert_trees_close(jax.device_get(state), before, atol=0, rtol=0)
  assert len(eng.programs._exercised) == 1
  eng.exercise(state, batch, plan)          # once per compiled step
  assert len(eng.programs._exercised) == 1


def test_off_cpu_warm_up_compiles_but_runs_no_step_on_a_copy_of_the_state(monkeypatch):
  # Off CPU a scratch copy would double a state that may fill the accelerator.
  eng = helpers.make_engine("gpt", tensor=N)
  assert eng.programs.scratch_runs                      # CPU devices
  monkeypatch.setattr(eng.programs, "scratch_runs", False)
  layout = bucketed_even()
  state = eng.init(0, layout)
  batch = eng.shard_batch(helpers.make_batch("gpt"))
  compiled, runs = eng.programs.compiled_fn, []

  def counting(*args):
    fn = compiled(*args)
    return lambda *a: runs.append(a) or fn(*a)

  monkeypatch.setattr(eng.programs, "compiled_fn", counting)
  before = eng.compile_count
  eng.exercise(state, batch, eng.plan(layout))
  assert eng.compile_count == before + 1 and runs == []
  assert warmup_lib.WarmUp(eng, None, None)._trial(state, batch, 0, None) is None


def test_one_engine_runs_the_same_widths_at_two_capacities():
  # The even split at capacity 12 (widths (12,)) and in the bucket (narrowed to (12,)) share
  # plan widths but not parameter shapes: each needs, and gets, its own compiled step.
  eng = helpers.make_engine("gpt", tensor=N)
  batch = eng.shard_batch(helpers.make_batch("gpt"))
  losses = []
  for layout in (helpers.even_layout(N), bucketed_even()):
    state = eng.init(0, layout)
    _, m = eng.train_step(state, batch, eng.plan(layout, widths=plan_lib.uniform_widths(layout)))
    losses.append(float(m["loss"]))
  np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)


def test_executed_widths_on_the_host_follow_the_resize_mode():
  # Widths (6, 12, 18, 24) for 12 owned MLP units per device; device 0 resized to keep 5 of them
  # in layer 0 (units mode: width 6), nothing skipped in layer 1.
  layout = bucketed_even()
  n = layout.num_devices
  kept = np.full((n, 2), 12)
  kept[0, 0] = 5
  resize = types.SimpleNamespace(mode="units", kept={"mlp": kept, "heads": np.full((n, 2), 2)})
  got = plan_lib.executed_widths(layout, 2, resize=resize)
  want = np.full((n, 2), 12.0)
  want[0, 0] = 6.0
  assert layout.mlp.widths == (6, 12, 18, 24)
  np.testing.assert_array_equal(got["mlp"], want)
  np.testing.assert_array_equal(plan_lib.executed_widths(layout, 2)["mlp"], np.full((n, 2), 12.0))
  # Contraction mode: a resized device executes its active width times the compiled fraction.
  frac = np.zeros((n, 2), int)
  frac[1, 1] = 0                      # fraction 0.5 where device 1 skips features in layer 1
  feats_kept = np.full((n, 2), 32)
  feats_kept[1, 1] = 16
  contraction = types.SimpleNamespace(
      mode="contraction", fractions=(0.5, 1.0), kept={k: np.full((n, 2), c) for k, c in
                                                      (("mlp", 12), ("heads", 2))},
      feats={k: np.zeros((n, 2, 32)) for k in ("mlp", "heads")},
      feats_kept={k: feats_kept for k in ("mlp", "heads")},
      frac={k: frac for k in ("mlp", "heads")})
  got = plan_lib.executed_widths(layout, 2, resize=contraction)
  want = np.full((n, 2), 12.0)
  want[1, 1] = 6.0
  np.testing.assert_array_equal(got["mlp"], want)
