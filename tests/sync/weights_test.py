"""SSAW's weights and learning-rate scale (`sync.weights`), and async's plain mean."""

import numpy as np
import pytest

from semijax.sync import settings as settings_lib
from semijax.sync import weights


def settings(**kw):
  return settings_lib.SyncSettings(**{"mode": "ssaw", **kw})


def test_every_round_is_a_full_step_by_default():
  c = weights.combine([4, 4, 4], [0, 0, 1], 16, settings())
  assert c.lr_scale == 1.0


def test_a_full_fresh_round_is_the_global_batch_mean_at_full_rate():
  c = weights.combine([4, 4, 4, 4], [0, 0, 0, 0], 16, settings())
  np.testing.assert_array_equal(c.weights, [0.25] * 4)
  assert c.lr_scale == 1.0 and c.samples == 16


def test_samples_weigh_and_staleness_discounts():
  c = weights.combine([4, 8, 4], [0, 0, 1], 16, settings(lr_batch_power=0.5))
  w = np.array([4, 8, 4 / 2])                    # poly, power 1: a 1-stale gradient counts half
  np.testing.assert_allclose(c.weights, w / w.sum())
  assert c.lr_scale == pytest.approx(np.sqrt(w.sum() / 16))   # Adam's square-root rule


@pytest.mark.parametrize("kw, expected", [
    ({"weighting": "poly", "staleness_power": 2.0}, [1, 1 / 4, 1 / 9]),
    ({"weighting": "exp", "staleness_decay": 0.5}, [1, 0.5, 0.25]),
    ({"weighting": "samples"}, [1, 1, 1]),
])
def test_discount_rules(kw, expected):
  np.testing.assert_allclose(weights.discount([0, 1, 2], settings(**kw)), expected)


def test_lr_batch_power():
  half = weights.combine([4, 4], [0, 0], 16, settings(lr_batch_power=1.0))
  assert half.lr_scale == 0.5
  assert weights.combine([4, 4], [0, 0], 16, settings(lr_batch_power=0.0)).lr_scale == 1.0


def test_async_is_unweighted_at_the_full_rate():
  c = weights.combine([4, 4, 4], [0, 0, 3], 16, settings(mode="async"))
  np.testing.assert_allclose(c.weights, [1 / 3] * 3)
  assert c.lr_scale == 1.0


def test_an_empty_round_is_refused():
  with pytest.raises(ValueError, match="samples"):
    weights.combine([0, 0], [0, 0], 16, settings())
