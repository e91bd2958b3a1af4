"""The round rule on a clock (`sync.timeline`): who is in which update, how stale, and when."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings as hypothesis_settings, strategies as st

from helpers import timeline_rounds
from semijax.sync import settings as settings_lib
from semijax.sync import timeline as timeline_lib


def applied(rounds):
  return sorted(j for r in rounds for j in r.microbatches)


@pytest.mark.parametrize("mode", ["ssaw", "async", "sync"])
def test_equal_speeds_make_synchronous_steps(mode):
  rounds = timeline_rounds([1.0] * 4, mode)
  assert len(rounds) == 6
  assert all(r.is_step(4, 2) for r in rounds)
  assert [r.close_s for r in rounds] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]


def test_a_slow_replica_is_applied_late_and_takes_less_data():
  rounds = timeline_rounds([1.0, 1.0, 1.0, 2.0], steps=6)
  assert applied(rounds) == list(range(24))                       # every microbatch once
  # The fast three close a round every second; the slow one joins every other round, 1 late.
  assert [r.members for r in rounds[:4]] == [(0, 1, 2), (0, 1, 2, 3)] * 2
  assert [r.staleness for r in rounds[:2]] == [(0, 0, 0), (0, 0, 0, 1)]
  assert [r.close_s for r in rounds[:4]] == [1.0, 2.0, 3.0, 4.0]
  per_replica = [sum(r.members.count(i) for r in rounds) for i in range(4)]
  assert per_replica[3] < min(per_replica[:3])                    # the fast take more data
  assert not any(r.is_step(4, 2) for r in rounds)


def test_the_staleness_bound_makes_the_fast_wait():
  rounds = timeline_rounds([1.0, 1.0, 8.0], steps=8, staleness_bound=2)
  assert max(s for r in rounds for s in r.staleness) <= 2
  # Without the bound the slow replica would arrive 7 updates late; with it, the third round
  # waits for it: it closes at 8 s, not 3 s.
  assert rounds[2].close_s == 8.0 and 2 in rounds[2].members
  assert applied(rounds) == list(range(24))


def test_sync_waits_for_the_slowest_every_round():
  rounds = timeline_rounds([1.0, 3.0], mode="sync", steps=4)
  assert [r.close_s for r in rounds] == [3.0, 6.0, 9.0, 12.0]
  assert all(r.members == (0, 1) for r in rounds)


def test_grace_absorbs_small_differences_and_async_does_not():
  ssaw = timeline_rounds([1.0, 1.1, 1.0], mode="ssaw", grace=0.25)
  assert all(r.members == (0, 1, 2) and not any(r.staleness) for r in ssaw)
  no_grace = timeline_rounds([1.0, 1.1, 1.0], mode="async")
  assert any(r.members == (0, 2) for r in no_grace)
  assert applied(no_grace) == list(range(18))


def test_the_end_of_the_stream_waits_for_everyone():
  rounds = timeline_rounds([1.0, 1.0, 5.0], steps=3)
  last = rounds[-1]
  assert 2 in last.members
  assert applied(rounds) == list(range(9))


def test_state_dict_continues_the_same_rounds():
  s = settings_lib.SyncSettings(mode="ssaw")
  speeds = [1.0, 2.5, 1.0, 4.0]
  whole = timeline_rounds(speeds, steps=5)
  line = timeline_lib.Timeline(s, 4, 2, 20)
  line.start(speeds)
  first = []
  for _ in range(3):
    first.append(line.take())
    line.start(speeds)
  copy = timeline_lib.Timeline(s, 4, 2, 20)
  copy.load_state_dict(line.state_dict())
  rest = []
  while (rnd := copy.take()) is not None:
    rest.append(rnd)
    copy.start(speeds)
  assert first + rest == whole


@hypothesis_settings(max_examples=40, deadline=None, derandomize=True)
@given(speeds=st.lists(st.sampled_from([1.0, 1.0, 1.3, 2.0, 3.7, 4.0]), min_size=2, max_size=6),
       bound=st.integers(0, 4), mode=st.sampled_from(["ssaw", "async"]),
       steps=st.integers(1, 6))
def test_every_microbatch_once_within_the_bound(speeds, bound, mode, steps):
  rounds = timeline_rounds(speeds, mode, steps=steps, staleness_bound=bound)
  assert applied(rounds) == list(range(steps * len(speeds)))
  assert max(s for r in rounds for s in r.staleness) <= bound
  closes = [r.close_s for r in rounds]
  assert closes == sorted(closes)
  assert [r.version for r in rounds] == list(range(1, len(rounds) + 1))
  # A member's gradient was computed on a version no newer than the one before its round.
  for r in rounds:
    assert all(0 <= s < r.version for s in r.staleness)


def test_round_is_step_needs_one_aligned_global_batch():
  step = timeline_lib.Round(3, 2.0, 3.0, (0, 1), (4, 5), (0, 0), (2, 2))
  assert step.is_step(2, 2)
  assert not dataclasses.replace(step, microbatches=(5, 6)).is_step(2, 2)
  assert not dataclasses.replace(step, staleness=(0, 1)).is_step(2, 2)
  assert not dataclasses.replace(step, members=(0,), microbatches=(4,), staleness=(0,),
                                 samples=(2,)).is_step(2, 2)
  assert np.isclose(step.close_s - step.open_s, 1.0)
