"""config.optimizer: the learning-rate schedule and AdamW's step, each against the formula
written out here; a run longer than its schedule goes on at the final rate; runs on one schedule
share an engine."""

import math

import jax
import numpy as np
import pytest

from helpers import tiny_gpt
from semijax.core import pipeline
from semijax.errors import ConfigError
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import optimizer as optimizer_lib
from semijax.train import tensor


def expected_rate(step, peak, warmup, length):
  """Linear warm-up from 0 to `peak` over `warmup` steps (at most length - 1), then cosine decay
  to peak / 10 at step `length`, held after it."""
  warmup = min(warmup, length - 1)
  if step < warmup:
    return peak * step / warmup
  t = min(step - warmup, length - warmup) / (length - warmup)
  return peak / 10 + (peak - peak / 10) * 0.5 * (1 + math.cos(math.pi * t))


@pytest.mark.parametrize("warmup, steps, schedule_steps", [
    (3, 10, 0),      # warm-up, then decay over the run
    (2, 15, 10),     # a run longer than its schedule: the schedule of 10, then its last rate
    (20, 6, 0),      # warm-up longer than the run: cut to steps - 1
])
def test_schedule_is_linear_warmup_then_cosine_to_a_tenth(warmup, steps, schedule_steps):
  spec = optimizer_lib.OptimizerSpec(learning_rate=1e-2, warmup_steps=warmup,
                                     schedule_steps=schedule_steps)
  schedule = optimizer_lib.learning_rate_schedule(spec, steps)
  length = schedule_steps or steps
  np.testing.assert_allclose([float(schedule(s)) for s in range(steps + 2)],
                             [expected_rate(s, 1e-2, warmup, length) for s in range(steps + 2)],
                             rtol=1e-5, atol=1e-9)


# A pipelined tree: shared parameters, and blocks stacked on a leading layer axis (whose
# [layers, d] bias is a bias per layer, not a matrix).
SHAPES = {"shared/w": (3, 2), "shared/b": (2,), "stack/w": (2, 3, 2), "stack/b": (2, 2)}
DECAYED = ("shared/w", "stack/w")


def adamw_steps(spec, params, grads_per_step, steps):
  """numpy AdamW of `spec` (a run of `steps`) on a flat {name: array} tree, with
  `spec.grad_clip`'s global-norm clip and weight decay on DECAYED only; the params after each
  step."""
  m = {k: np.zeros_like(v) for k, v in params.items()}
  v = {k: np.zeros_like(x) for k, x in params.items()}
  p = {k: x.astype(np.float64) for k, x in params.items()}
  out = []
  for t, grads in enumerate(grads_per_step):
    norm = math.sqrt(sum(float((g ** 2).sum()) for g in grads.values()))
    scale = min(1.0, spec.grad_clip / norm)
    lr = expected_rate(t, spec.learning_rate, spec.warmup_steps, steps)
    for k in p:
      g = grads[k] * scale
      m[k] = spec.b1 * m[k] + (1 - spec.b1) * g
      v[k] = spec.b2 * v[k] + (1 - spec.b2) * g ** 2
      m_hat, v_hat = m[k] / (1 - spec.b1 ** (t + 1)), v[k] / (1 - spec.b2 ** (t + 1))
      decay = spec.weight_decay * p[k] if k in DECAYED else 0.0
      p[k] = p[k] - lr * (m_hat / (np.sqrt(v_hat) + 1e-8) + decay)
    out.append({k: x.copy() for k, x in p.items()})
  return out


def nested(flat):
  return {pipeline.SHARED: {"w": flat["shared/w"], "b": flat["shared/b"]},
          pipeline.STACK: {"w": flat["stack/w"], "b": flat["stack/b"]}}


def test_adamw_step_clips_the_global_norm_and_decays_matrices_only():
  spec = optimizer_lib.OptimizerSpec(learning_rate=0.1, warmup_steps=1, weight_decay=0.5,
                                     b1=0.8, b2=0.9, grad_clip=1.0)
  rng = np.random.default_rng(0)
  params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
  grads = [{k: (rng.normal(size=s) * f).astype(np.float32) for k, s in SHAPES.items()}
           for f in (1.0, 0.1, 2.0)]
  norms = [math.sqrt(sum(float((x ** 2).sum()) for x in g.values())) for g in grads]
  assert norms[0] > 1 > norms[1] and norms[2] > 1          # steps 0 and 2 clipped, 1 not
  want = adamw_steps(spec, params, grads, steps=4)
  tx = optimizer_lib.make(spec, 4)
  p = nested(params)
  state = tx.init(p)

  @jax.jit
  def step(p, state, g):
    updates, state = tx.update(g, state, p)
    return jax.tree.map(lambda a, b: a + b, p, updates), state

  for t, g in enumerate(grads):
    p, state = step(p, state, nested(g))
    for k, x in nested(want[t]).items():
      for name, expected in x.items():
        np.testing.assert_allclose(np.asarray(p[k][name]), expected, rtol=2e-5, atol=1e-6,
                                   err_msg=f"step {t} {k}/{name}")


def test_schedule_steps_is_checked():
  c = tiny_gpt()
  c.optimizer.schedule_steps = -1
  with pytest.raises(ConfigError, match=r"^config.optimizer.schedule_steps: must be an integer"):
    config_lib.validate(c)


def test_runs_on_one_schedule_share_an_engine_and_train_as_a_fresh_one(tmp_path):
  def run(steps, schedule_steps=0):
    c = tiny_gpt(steps=steps)
    c.optimizer.schedule_steps = schedule_steps
    return c

  cache = {}
  train.train_and_evaluate(run(2, schedule_steps=4), str(tmp_path / "short"), engine_cache=cache)
  shared = train.train_and_evaluate(run(4), str(tmp_path / "shared"), engine_cache=cache)
  assert len(cache) == 1
  fresh = train.train_and_evaluate(run(4), str(tmp_path / "fresh"))
  np.testing.assert_array_equal(shared["losses"], fresh["losses"])
  np.testing.assert_array_equal(shared["val/loss"], fresh["val/loss"])
  tensor.cached_engine(config_lib.validate(run(3)), cache)     # another schedule: its own
  assert len(cache) == 2
