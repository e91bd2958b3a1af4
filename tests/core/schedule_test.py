"""Pipeline tick tables and their step time: hand-worked cases, the dependency rules checked by
an independent checker on every small size, 1f1b's stash bound, gpipe's order, and the fewest
ticks against a breadth-first search over every schedule the rules allow."""

import itertools

import numpy as np
import pytest

from semijax.core import schedule

SIZES = [(s, m) for s in range(1, 6) for m in range(1, 10)]


def ticks_of(tab):
  """({(s, m): tick of F}, {(s, m): tick of B}), asserting each runs exactly once."""
  fwd, bwd = {}, {}
  for t, s in itertools.product(range(tab.shape[0]), range(tab.shape[1])):
    for col, seen in ((0, fwd), (1, bwd)):
      m = int(tab[t, s, col])
      if m >= 0:
        assert (s, m) not in seen, f"stage {s} runs microbatch {m} twice"
        seen[(s, m)] = t
  return fwd, bwd


def check_rules(tab, s_, m_):
  fwd, bwd = ticks_of(tab)
  every = {(s, m) for s in range(s_) for m in range(m_)}
  assert set(fwd) == every and set(bwd) == every
  for s, m in every:
    if s > 0:
      assert fwd[(s, m)] > fwd[(s - 1, m)]
    if s < s_ - 1:
      assert bwd[(s, m)] > bwd[(s + 1, m)]
      assert bwd[(s, m)] > fwd[(s, m)]
    else:
      assert bwd[(s, m)] >= fwd[(s, m)]
  # Microbatches in order on every stage (gpipe's backwards in reverse).
  return fwd, bwd


def held_between_ticks(tab):
  """[T, S]: microbatches forward-done and backward-not after each tick, counted one by one."""
  fwd, bwd = ticks_of(tab)
  out = np.zeros(tab.shape[:2], int)
  for t, s in itertools.product(range(tab.shape[0]), range(tab.shape[1])):
    out[t, s] = sum(1 for (ss, m), ft in fwd.items() if ss == s and ft <= t < bwd[(s, m)])
  return out


def greedy_1f1b(s_, m_):
  """1f1b tick by tick, as the engine's lockstep sees it: in every tick each stage runs its next
  backward if its dependencies ran in earlier ticks (the last stage: also the forward of this
  tick), and its next forward if its input arrived and at most S - s stay in flight."""
  fwd, bwd = {}, {}
  nf, nb, rows = [0] * s_, [0] * s_, []
  while min(nb) < m_:
    t, row = len(rows), np.full((s_, 2), -1)
    for s in range(s_):
      bm, fm = nb[s], nf[s]
      back = (bm < m_ and fwd.get((s, bm), t) < t
              and (s == s_ - 1 or bwd.get((s + 1, bm), t) < t))
      go = (fm < m_ and (s == 0 or fwd.get((s - 1, fm), t) < t)
            and (fm + 1) - (bm + back) <= s_ - s)
      if go:
        fwd[(s, fm)], row[s, 0], nf[s] = t, fm, fm + 1
      if not back and go and s == s_ - 1 and bm == fm:
        back = True
      if back:
        bwd[(s, bm)], row[s, 1], nb[s] = t, bm, bm + 1
    rows.append(row)
  return np.stack(rows)


def fewest_ticks(s_, m_, bound):
  """Breadth-first search over every schedule (microbatches in order per stage) that keeps the
  rules and at most bound(s) in flight on stage s between ticks: the fewest ticks."""
  start, goal = ((0, 0),) * s_, ((m_, m_),) * s_
  frontier, ticks = {start}, 0
  while goal not in frontier:
    nxt = set()
    for state in frontier:
      options = []
      for s, (nf, nb) in enumerate(state):
        can_f = nf < m_ and (s == 0 or state[s - 1][0] > nf)
        can_b = nb < nf and (s == s_ - 1 or state[s + 1][1] > nb)
        same_tick = s == s_ - 1 and nb == nf < m_     # the loss's backward after its forward
        options.append([(nf + df, nb + db) for df in (0, 1) for db in (0, 1)
                        if (not df or can_f) and (not db or can_b or (same_tick and df))
                        and nb + db <= nf + df and (nf + df) - (nb + db) <= bound(s)])
      nxt.update(itertools.product(*options))
    frontier, ticks = nxt, ticks + 1
  return ticks


def test_gpipe_by_hand():
  tab = schedule.table("gpipe", 2, 2)
  want = [[[0, -1], [-1, -1]],
          [[1, -1], [0, -1]],
          [[-1, -1], [1, 1]],
          [[-1, 1], [-1, 0]],
          [[-1, 0], [-1, -1]]]
  np.testing.assert_array_equal(tab, want)
  assert tab.dtype == np.int32
  np.testing.assert_array_equal(schedule.in_flight(tab), [2, 1])


def test_1f1b_by_hand_and_its_step_time():
  tab = schedule.table("1f1b", 2, 3)
  want = [[[0, -1], [-1, -1]],
          [[1, -1], [0, 0]],
          [[2, 0], [1, 1]],
          [[-1, 1], [2, 2]],
          [[-1, 2], [-1, -1]]]
  np.testing.assert_array_equal(tab, want)
  # Per tick: slowest stage's compute + slowest transfer (stage 0 sends forward 0.5 s, stage 1
  # sends cotangents back 0.25 s).
  # t0: 1 + .5; t1: max(1, 2+5) + max(.5, .25); t2: max(1+3, 7) + .5; t3: max(3, 7) + .25; t4: 3.
  got = schedule.step_time(tab, [1.0, 2.0], [3.0, 5.0], [0.5], [0.25])
  assert got == pytest.approx(1.5 + 7.5 + 7.5 + 7.25 + 3.0)


def test_step_time_single_stage_and_batches():
  tab = schedule.table("gpipe", 1, 3)
  assert schedule.step_time(tab, [2.0], [5.0], [], []) == pytest.approx(21.0)
  tab = schedule.table("gpipe", 3, 4)
  f = np.array([[1.0, 2.0, 1.5], [0.5, 0.5, 0.5]])
  b = 3 * f
  sends = np.array([[0.1, 0.2], [0.0, 0.0]])
  batch = schedule.step_time(tab, f, b, sends, sends)
  assert batch.shape == (2,)
  for i in range(2):
    assert batch[i] == pytest.approx(schedule.step_time(tab, f[i], b[i], sends[i], sends[i]))
  # Equal stages without transfers: GPipe's (M + S - 1) (f + b).
  assert batch[1] == pytest.approx((4 + 3 - 1) * (0.5 + 1.5))


def test_step_time_against_a_loop():
  rng = np.random.default_rng(0)
  for sched, (s_, m_) in itertools.product(schedule.SCHEDULES, [(1, 3), (3, 5), (4, 2)]):
    tab = schedule.table(sched, s_, m_)
    f, b = rng.uniform(0.1, 1, s_), rng.uniform(0.1, 3, s_)
    sf, sb = rng.uniform(0, 0.5, s_ - 1), rng.uniform(0, 0.5, s_ - 1)
    want = 0.0
    for row in tab:
      want += max((f[s] if row[s, 0] >= 0 else 0) + (b[s] if row[s, 1] >= 0 else 0)
                  for s in range(s_))
      sends = [sf[s] for s in range(s_ - 1) if row[s, 0] >= 0]
      sends += [sb[s - 1] for s in range(1, s_) if row[s, 1] >= 0]
      want += max(sends, default=0.0)
    assert schedule.step_time(tab, f, b, sf, sb) == pytest.approx(want)


@pytest.mark.parametrize("sched", schedule.SCHEDULES)
def test_dependency_rules_on_every_small_size(sched):
  for s_, m_ in SIZES:
    tab = schedule.table(sched, s_, m_)
    assert tab.shape[1:] == (s_, 2)
    fwd, bwd = check_rules(tab, s_, m_)
    for s in range(s_):   # in order per stage (gpipe's backward in reverse)
      f_order = sorted(range(m_), key=lambda m: fwd[(s, m)])
      b_order = sorted(range(m_), key=lambda m: bwd[(s, m)])
      assert f_order == list(range(m_))
      assert b_order == (list(range(m_))[::-1] if sched == "gpipe" else list(range(m_)))
    np.testing.assert_array_equal(schedule.in_flight(tab), held_between_ticks(tab).max(axis=0))


def test_gpipe_runs_every_forward_first():
  for s_, m_ in SIZES:
    tab = schedule.table("gpipe", s_, m_)
    fwd, bwd = ticks_of(tab)
    assert len(tab) == 2 * (s_ + m_) - 3
    for s in range(s_):
      last_f = max(fwd[(s, m)] for m in range(m_))
      for m in range(m_):
        if s == s_ - 1 and m == m_ - 1:
          assert bwd[(s, m)] == last_f       # the only backward in a forward's tick
        else:
          assert bwd[(s, m)] > last_f
    want = [m_] * (s_ - 1) + [m_ - 1]
    np.testing.assert_array_equal(schedule.in_flight(tab), want)


def test_1f1b_stash_bound_and_warm_up():
  for s_, m_ in SIZES:
    tab = schedule.table("1f1b", s_, m_)
    held = schedule.in_flight(tab)
    assert np.all(held <= s_ - np.arange(s_)), (s_, m_, held)
    # The bound is reached where there are enough microbatches (warm-up fills it); a single
    # stage is the last one, whose backward shares its forward's tick.
    assert held[0] == (min(s_, m_) if s_ > 1 else 0)
    # Fewer microbatches in flight than gpipe once M > S.
    if m_ > s_:
      assert held[0] < schedule.in_flight(schedule.table("gpipe", s_, m_))[0]


@pytest.mark.parametrize("s_,m_", [(s, m) for s in range(1, 5) for m in range(1, 7)])
def test_1f1b_has_the_fewest_ticks_its_rules_allow(s_, m_):
  tab = schedule.table("1f1b", s_, m_)
  assert len(tab) == fewest_ticks(s_, m_, lambda s: s_ - s)


def test_1f1b_is_the_tick_by_tick_greedy():
  # The library computes ticks per microbatch and repeats a detected period; long pipelines
  # reach the period, short ones do not.
  for s_, m_ in SIZES + [(2, 31), (3, 40), (4, 57), (5, 64), (7, 90)]:
    np.testing.assert_array_equal(schedule.table("1f1b", s_, m_), greedy_1f1b(s_, m_))


def test_fewest_ticks_search_can_tell_schedules_apart():
  # The search itself: without the stash bound the same rules allow 2S + M - 2 ticks, fewer
  # than 1f1b takes for S >= 3 and M > 2.
  assert fewest_ticks(3, 4, lambda s: 99) == 2 * 3 + 4 - 2
  assert len(schedule.table("1f1b", 3, 4)) > 2 * 3 + 4 - 2


def test_bubble():
  s_, m_ = 4, 6
  tab = schedule.table("gpipe", s_, m_)
  assert schedule.bubble(tab, [1.0] * s_, [2.0] * s_) == pytest.approx((s_ - 1) / (m_ + s_ - 1))
  assert schedule.bubble(schedule.table("1f1b", 1, 5), [1.0], [2.0]) == pytest.approx(0.0)
  # A slow stage idles the others: stage 1 takes 3x, the others wait.
  tab = schedule.table("gpipe", 2, 1)
  # Ticks: (s0 F: 1), (s1 F+B: 3 + 6), (s0 B: 2); work 1 + 2 + 9 = 12 of 2 x 12 stage-seconds.
  assert schedule.bubble(tab, [1.0, 3.0], [2.0, 6.0]) == pytest.approx(0.5)


def test_bad_arguments_name_themselves():
  with pytest.raises(ValueError, match="schedule"):
    schedule.table("zb", 2, 2)
  with pytest.raises(ValueError, match="num_stages"):
    schedule.table("gpipe", 0, 2)
  with pytest.raises(ValueError, match="num_microbatches"):
    schedule.table("1f1b", 2, 1.5)
  tab = schedule.table("gpipe", 2, 2)
  with pytest.raises(ValueError, match="f_s"):
    schedule.step_time(tab, [1.0], [1.0, 1.0], [0.0], [0.0])
  with pytest.raises(ValueError, match="send_b"):
    schedule.step_time(tab, [1.0, 1.0], [1.0, 1.0], [0.0], [-1.0])
  with pytest.raises(ValueError, match="table"):
    schedule.in_flight(np.zeros((3, 2)))


def test_link_and_stage_formulas():
  assert schedule.allreduce_s(100.0, 1, 1.0, 1.0) == 0.0
  # 4 members: 6 latency rounds, each member sends 2 * 3/4 of the bytes.
  assert schedule.allreduce_s(800.0, 4, 0.5, 100.0) == pytest.approx(6 * 0.5 + 1.5 * 8.0)
  assert schedule.send_s(300.0, 0.25, 100.0) == pytest.approx(3.25)
  f, b = schedule.stage_seconds([2, 3], [1.0, 2.0], [0.5, 0.0])
  np.testing.assert_allclose(f, [2 * (1 + 1), 3 * 2])
  np.testing.assert_allclose(b, [2 * (3 + 2), 3 * 6])
