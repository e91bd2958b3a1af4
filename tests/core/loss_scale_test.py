"""Dynamic loss scaling (`core.loss_scale`, `config.optimizer.loss_scale`). The CPU backend has
no float16 GEMMs, so these run in float32, where a power-of-two scale is exact: a scaled step
must equal the unscaled one bit for bit, and an overflowing scale must skip its step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import helpers as H
import pipeline_test
from semijax.core import loss_scale
from semijax.errors import ConfigError
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics


def test_a_step_with_a_gradient_that_is_not_finite_changes_nothing_and_halves_the_scale():
  tx = loss_scale.dynamic(optax.adam(0.1), initial=8.0, period=2)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  good = {"w": jnp.full(3, 0.5)}
  want, _ = optax.adam(0.1).update(good, optax.adam(0.1).init(params), params)
  updates, state = tx.update(good, state, params)
  np.testing.assert_array_equal(updates["w"], want["w"])
  assert (float(state.scale), int(state.good_steps)) == (8.0, 1)
  _, state = tx.update(good, state, params)                 # the second finite step in a row
  assert (float(state.scale), int(state.good_steps)) == (16.0, 0)
  before = state.inner
  updates, state = tx.update({"w": jnp.array([1.0, jnp.inf, 1.0])}, state, params)
  assert not np.any(np.asarray(updates["w"]))
  assert (float(state.scale), int(state.good_steps)) == (8.0, 0)
  jax.tree.map(np.testing.assert_array_equal, state.inner, before)   # Adam's count and moments
  floor = loss_scale.dynamic(optax.sgd(0.1), initial=1.0)
  _, low = floor.update({"w": jnp.full(3, jnp.nan)}, floor.init(params), params)
  assert float(low.scale) == loss_scale.MINIMUM
  assert loss_scale.scale_of(state) is state.scale and loss_scale.scale_of(before) is None


def _engines(accumulation, initial):
  """(plain engine, engine whose AdamW is wrapped in dynamic loss scaling) on a 2x4 mesh."""
  adamw = optax.adamw(3e-3, weight_decay=0.1)
  return [H.make_engine("gpt", data=2, tensor=4, tx=tx, accumulation=accumulation)
          for tx in (adamw, loss_scale.dynamic(adamw, initial=initial, period=2))]


@pytest.mark.parametrize("accumulation", [1, 2])
def test_a_scaled_step_equals_the_unscaled_one_bit_for_bit(accumulation):
  plain, scaled = _engines(accumulation, 2.0 ** 12)
  layout = H.random_layout(5, 4)
  states = [e.to_padded(e.init_logical(0), layout) for e in (plain, scaled)]
  jax.tree.map(np.testing.assert_array_equal, states[0].params, states[1].params)
  plan = plain.plan(layout)
  scales = []
  for step in range(4):
    batch = plain.shard_batch(H.make_batch("gpt", seed=30 + step, batch_size=8))
    states[0], m0 = plain.train_step(states[0], batch, plan)
    states[1], m1 = scaled.train_step(states[1], batch, plan)
    assert float(m1["loss"]) == float(m0["loss"]) and float(m1["grad_norm"]) == float(
        m0["grad_norm"])
    scales.append(float(m1["loss_scale"]))
  jax.tree.map(np.testing.assert_array_equal, states[1].params, states[0].params)
  assert scales == [2.0 ** 12, 2.0 ** 12, 2.0 ** 13, 2.0 ** 13]     # doubles every 2 steps


def _until_applied(engine, state, batch, plan, tries):
  """Train steps of `engine` (its optimizer under dynamic scaling) on `batch` until one applies
  (its scale did not halve), at most `tries`; every skipped step has a gradient that is not
  finite and leaves the parameters bit for bit. Returns (state, the parameters before the last
  step, the scale of each step)."""
  scales = []
  for _ in range(tries):
    before = jax.tree.map(np.asarray, state.params)
    state, m = engine.train_step(state, batch, plan)
    scales.append(float(m["loss_scale"]))
    if float(loss_scale.scale_of(state.opt_state)) >= scales[-1]:    # applied: did not halve
      break
    assert not np.isfinite(float(m["grad_norm"]))
    jax.tree.map(np.testing.assert_array_equal, state.params, before)
  return state, before, scales


def test_an_overflowing_scale_skips_steps_until_it_fits():
  """float32 overflows at 2^128: a loss of about 4 times 2^127 is infinite, so the first steps
  are skipped (the parameters stay bit for bit), the scale halving each time; the first step
  that fits is the unscaled engine's first step."""
  plain, scaled = _engines(1, 2.0 ** 127)
  layout = H.random_layout(6, 4)
  plan = plain.plan(layout)
  start = scaled.to_padded(scaled.init_logical(0), layout)
  first = jax.tree.map(np.asarray, start.params)
  batch = plain.shard_batch(H.make_batch("gpt", seed=3, batch_size=8))
  want, _ = plain.train_step(plain.to_padded(plain.init_logical(0), layout), batch, plan)
  state, before, scales = _until_applied(scaled, start, batch, plan, 8)
  skipped = len(scales) - 1
  assert 1 <= skipped < 8 and scales == [2.0 ** (127 - i) for i in range(len(scales))]
  jax.tree.map(np.testing.assert_array_equal, before, first)
  jax.tree.map(np.testing.assert_array_equal, state.params, want.params)


def test_a_scaled_pipelined_step_equals_the_unscaled_one_bit_for_bit():
  """The last stage seeds its backward pass with the scale over the tokens: every stage's
  gradients come back times it, and divided they are the unscaled step's (1f1b, pipelines
  running 3 and 1 microbatches)."""
  stage_layers, microbatches = (1, 3), (3, 1)
  adamw = optax.adamw(3e-3, weight_decay=0.1)
  engines = [pipeline_test.make(2, 2, "1f1b", max(microbatches), tx=tx)
             for tx in (adamw, loss_scale.dynamic(adamw, initial=2.0 ** 12, period=2))]
  layout = pipeline_test.stage_layout(stage_layers)
  states = [e.to_padded(e.init_logical(0), layout) for e in engines]
  pplan = engines[0].plan(layout, microbatches)
  scales = []
  for step in range(3):
    batch = engines[0].arrange_batch(H.make_batch("gpt", step, batch_size=8), microbatches)
    (states[0], m0), (states[1], m1) = (e.train_step(s, batch, pplan)
                                        for e, s in zip(engines, states))
    assert float(m1["loss"]) == float(m0["loss"]) and float(m1["grad_norm"]) == float(
        m0["grad_norm"])
    scales.append(float(m1["loss_scale"]))
  jax.tree.map(np.testing.assert_array_equal, states[1].params, states[0].params)
  assert scales == [2.0 ** 12, 2.0 ** 12, 2.0 ** 13] and "loss_scale" not in m0


def test_an_overflowing_pipelined_step_applies_nothing_until_the_scale_fits():
  """One weighted token: its gradients' norm is 25, so a scale of 2^127 overflows them. The
  skipped steps leave the parameters bit for bit; the first that fits is the unscaled step."""
  adamw = optax.adamw(3e-3, weight_decay=0.1)
  plain, scaled = (pipeline_test.make(2, 2, "1f1b", 2, tx=tx)
                   for tx in (adamw, loss_scale.dynamic(adamw, initial=2.0 ** 127)))
  layout = pipeline_test.stage_layout((1, 3))
  pplan = plain.plan(layout, (2, 2))
  batch = H.make_batch("gpt", 0, batch_size=8)
  batch["weights"] = np.zeros(batch["targets"].shape, np.float32)
  batch["weights"][0, 3] = 1.0
  batch = plain.arrange_batch(batch, (2, 2))
  want, _ = plain.train_step(plain.to_padded(plain.init_logical(0), layout), batch, pplan)
  state = scaled.to_padded(scaled.init_logical(0), layout)
  first = jax.tree.map(np.asarray, state.params)
  state, before, scales = _until_applied(scaled, state, batch, pplan, 10)
  assert 2 <= len(scales) < 10 and scales == [2.0 ** (127 - i) for i in range(len(scales))]
  jax.tree.map(np.testing.assert_array_equal, before, first)
  jax.tree.map(np.testing.assert_array_equal, state.params, want.params)


def _validated(**edits):
  config = H.tiny_gpt(steps=4)
  for path, value in edits.items():
    section, _, name = path.rpartition(".")
    setattr(config[section] if section else config, name, value)
  return config_lib.validate(config, None, 1)


def test_auto_scales_float16_only_in_every_kind_of_run():
  pipelined = {"mesh.pipe": 2, "mesh.tensor": 2, "model.num_layers": 2}
  replicas = {"mesh.data": 2, "sync.mode": "ssaw"}
  for kind in ({}, pipelined, replicas, dict(pipelined, **replicas)):
    assert _validated(**kind, **{"model.dtype": "float16"}).optimizer.loss_scale == "dynamic"
    assert _validated(**kind, **{"model.dtype": "bfloat16"}).optimizer.loss_scale == "none"
    assert _validated(**kind, **{"optimizer.loss_scale": "dynamic"}
                      ).optimizer.loss_scale == "dynamic"
  with pytest.raises(ConfigError, match=r"^config.optimizer.loss_scale_init: must be a power "
                     r"of two >= 1"):
    _validated(**{"optimizer.loss_scale_init": 1000.0})
  with pytest.raises(ConfigError, match=r"^config.optimizer.loss_scale: 'static' is not one of"):
    _validated(**{"optimizer.loss_scale": "static"})


def test_a_scaled_run_resumes_its_scale_and_trains_like_the_unscaled_one(tmp_path, monkeypatch):
  reference = train.train_and_evaluate(H.tiny_gpt(steps=6), str(tmp_path / "plain"))
  config = H.tiny_gpt(steps=6)
  config.optimizer.loss_scale, config.optimizer.loss_scale_period = "dynamic", 2
  config.checkpoint_every, config.log_every = 3, 1
  workdir = str(tmp_path / "scaled")
  H.interrupted(monkeypatch, lambda: train.train_and_evaluate(config, workdir), 3)
  resumed = train.train_and_evaluate(config, workdir)
  assert resumed["start_step"] == 3
  # (Not bit for bit: the gradient clip's norm of the divided gradients fuses differently.)
  np.testing.assert_allclose(resumed["losses"], reference["losses"][3:], rtol=1e-6)
  s = 2.0 ** 15
  assert [r["train/loss_scale"] for r in metrics.read_jsonl(f"{workdir}/metrics.jsonl")] == [
      s, s, 2 * s, 2 * s, 4 * s, 4 * s]       # the checkpoint at step 3 held 2s and its count
  config.steps, config.optimizer.loss_scale = 8, "none"       # resume it without scaling
  with pytest.raises(ConfigError, match=r"^config.optimizer.loss_scale: the checkpoint at step 6 "
                     r".* was saved with loss scaling 'dynamic', this run has 'none'"):
    train.train_and_evaluate(config, workdir)


def test_a_migration_carries_the_scale_and_loses_nothing(tmp_path):
  """The scale and its count are optimizer state without a unit axis: a migration (device 0
  4x slower) moves the moments around them and the run still trains like the even one."""
  runs = {}
  for policy, scaling in (("even", "none"), ("migrate", "dynamic")):
    c = H.tiny_gpt(tensor=4, steps=8)
    c.hetero.slowdown, c.balance.policy = (4.0, 1.0, 1.0, 1.0), policy
    c.balance.patience = c.balance.min_dwell_steps = 1
    c.balance.num_widths = 8
    c.optimizer.loss_scale, c.optimizer.loss_scale_period = scaling, 3
    runs[policy] = train.train_and_evaluate(c, str(tmp_path / policy))
  assert runs["migrate"]["balance"]["migrations"] >= 1
  np.testing.assert_allclose(runs["migrate"]["losses"], runs["even"]["losses"], rtol=1e-5)
  scales = [r["train/loss_scale"] for r in metrics.read_jsonl(f"{tmp_path}/migrate/metrics.jsonl")]
  assert scales == [2.0 ** (15 + step // 3) for step in range(8)]
