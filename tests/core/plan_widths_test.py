"""The single-width step of an even split, and warm-up runs of every branch of a compiled step.

An even split inside a larger capacity bucket executes one width on every device; its exact step
can then be compiled with that width alone (no `lax.switch`, no rematerialization) and must give
the same logits and gradients as the branched step, compared here against the dense reference.
"""

import jax
import numpy as np
import pytest

import helpers
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
  taken = {k: sorted({int(kernels.bucket_index(np.asarray(p.active[k])[0], widths[k])) for p in plans})
           for k in widths}
  assert taken == {k: list(range(len(w))) for k, w in widths.items()}
  before = jax.device_get(state)
  eng.exercise(state, batch, plan)
  helpers.assert_trees_close(jax.device_get(state), before, atol=0, rtol=0)
  assert len(eng._exercised) == 1
  eng.exercise(state, batch, plan)          # once per compiled step
  assert len(eng._exercised) == 1


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
