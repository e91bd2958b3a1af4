"""config.optimizer.schedule_steps: a run longer than its schedule goes on at the final rate;
runs on one schedule share an engine."""

import numpy as np
import pytest

from helpers import tiny_gpt
from semijax.errors import ConfigError
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import optimizer as optimizer_lib


def test_a_longer_run_follows_the_budget_schedule_then_holds_its_last_rate():
  spec = optimizer_lib.OptimizerSpec(learning_rate=1e-2, warmup_steps=2, schedule_steps=10)
  longer = optimizer_lib.learning_rate_schedule(spec, 15)
  budget = optimizer_lib.learning_rate_schedule(
      optimizer_lib.OptimizerSpec(learning_rate=1e-2, warmup_steps=2), 10)
  np.testing.assert_array_equal([float(longer(s)) for s in range(10)],
                                [float(budget(s)) for s in range(10)])
  assert [float(longer(s)) for s in range(10, 15)] == pytest.approx([1e-3] * 5)


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
  train._cached_engine(config_lib.validate(run(3)), cache)     # another schedule: its own
  assert len(cache) == 2
