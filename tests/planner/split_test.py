"""The planner's sub-solvers against brute force: unit splits, layer partitions, microbatch
splits, and the monotonicity the microbatch split's exactness rests on."""

import itertools

import numpy as np
import pytest

from brute_force import compositions
from semijax.core import layout
from semijax.core import schedule
from semijax.planner import split


def test_proportional_counts_equal_the_layout_greedy():
  rng = np.random.default_rng(0)
  for _ in range(300):
    n = int(rng.integers(1, 9))
    units = int(rng.integers(n, 400))
    if rng.random() < 0.3:    # ties
      speeds = rng.choice([1.0, 0.5, 0.25], n)
    else:
      speeds = rng.uniform(0.01, 2.0, n)
    assert split.proportional_counts(units, speeds) == layout.proportional_counts(units, speeds)
  assert split.proportional_counts(16384, [1.0, 0.3, 0.7]) == layout.proportional_counts(
      16384, [1.0, 0.3, 0.7])
  with pytest.raises(ValueError):
    split.proportional_counts(2, [1.0, 1.0, 1.0])


def test_minmax_layers_is_the_best_partition():
  rng = np.random.default_rng(1)
  for _ in range(100):
    s_ = int(rng.integers(1, 5))
    total = int(rng.integers(s_, 12))
    w = rng.uniform(0.1, 3.0, s_)
    best = min(max(l * x for l, x in zip(c, w)) for c in compositions(total, s_))
    got = split.minmax_layers(total, w)
    assert sum(got) == total and min(got) >= 1
    assert max(l * x for l, x in zip(got, w)) == pytest.approx(best)


def test_compositions():
  assert split.compositions(4, 2).tolist() == [[1, 3], [2, 2], [3, 1]]
  for total, parts in [(5, 1), (6, 3), (7, 7), (3, 4)]:
    got = {tuple(r) for r in split.compositions(total, parts)}
    assert got == set(compositions(total, parts)) if parts <= total else got == set()
    assert split.num_compositions(total, parts) == len(got)


def monotone_times(rng, r_, k):
  return np.cumsum(rng.choice([0.0, 0.5, 1.0, 2.5], (r_, k)) * rng.uniform(0.5, 2, (r_, 1)),
                   axis=1) + rng.uniform(0, 3, (r_, 1))


def test_microbatch_splits_against_every_split():
  rng = np.random.default_rng(2)
  for _ in range(200):
    r_ = int(rng.integers(1, 5))
    total = int(rng.integers(r_, 10))
    times = monotone_times(rng, r_, total)
    if rng.random() < 0.2:
      times[rng.integers(r_), rng.integers(total):] = np.inf      # no room beyond some count
    best = min(max(times[d, m - 1] for d, m in enumerate(c)) for c in compositions(total, r_))
    assert split.split_value(times, total) == pytest.approx(best)
    start = split.proportional_counts(total, rng.uniform(0.1, 1, r_))
    value, counts = split.balance_split(lambda d, m: times[d, m - 1] if m <= total else np.inf,
                                        r_, total, start)
    assert value == pytest.approx(best) and sum(counts) == total and min(counts) >= 1
    assert max(times[d, m - 1] for d, m in enumerate(counts)) == pytest.approx(best)
  batched = monotone_times(rng, 3, 6)[None].repeat(4, axis=0)
  assert split.split_value(batched, 6).shape == (4,)
  assert np.isinf(split.split_value(batched[0], 2))                 # fewer than one each
  with pytest.raises(ValueError, match="start"):
    split.balance_split(lambda d, m: 1.0, 2, 4, (1, 1))


@pytest.mark.parametrize("sched", schedule.SCHEDULES)
def test_pipeline_time_never_falls_with_more_microbatches(sched):
  # What split_value's and balance_split's exactness rests on (split's module doc).
  rng = np.random.default_rng(3)
  for s_, trial in itertools.product(range(1, 7), range(15)):
    f = rng.uniform(0, 1, s_) * (rng.random(s_) < 0.8)
    b = f * rng.uniform(1, 4, s_)
    sends = rng.uniform(0, 1, (2, s_ - 1)) * (rng.random(s_ - 1) < 0.6)
    times = [schedule.step_time(schedule.table(sched, s_, m), f, b, *sends)
             for m in range(1, 3 * s_ + 4)]
    assert np.all(np.diff(times) >= -1e-12), (s_, trial)
