"""The multi-process round rule (`sync.real.Coordinator`) on a fake key-value store and clock.

`Job` plays the replicas of `real.RoundsReplica` against the coordinator in simulated time: each
claims a microbatch from the shared counter, posts "ready" when its fixed duration has passed,
reads the published rounds and starts again when it is a member. The store's blocking wait is
where the clock moves (to the next post, or by the timeout), so the whole run is deterministic.
The rounds it publishes must be `sync.timeline.Timeline`'s on the same durations: the same
members, microbatches, staleness and closing times, hand-picked and generated cases alike.
Timeline knows when each replica will arrive; the coordinator only estimates it from the
replica's last microbatch, so for the comparison it starts knowing the durations (what it does
before it knows them has a test of its own).
"""

import contextlib

import heapq
import json

import numpy as np
import pytest
from hypothesis import given, settings as hypothesis_settings, strategies as st

from helpers import timeline_rounds
from semijax.sync import real
from semijax.sync import settings as settings_lib
from semijax.sync import timeline as timeline_lib

MICROBATCH = 2           # samples per microbatch
HORIZON_S = 10_000.0     # a run still going at this simulated time is stuck


def learning_rate(progress):
  """A warm-up over 3 batches, then constant (0 at the start, as the real schedules)."""
  return min(1.0, progress / 3.0)


class Clock:
  """A `time` module stand-in for `real`: `perf_counter` is the simulated time."""

  def __init__(self):
    self.now = 0.0

  def perf_counter(self):
    return self.now


class Job:
  """The fake key-value store, and the replicas that use it (see module doc).

  Args:
    durations: seconds each replica takes per microbatch.
    total: the stream's length in microbatches.
  """

  def __init__(self, clock, durations, total):
    self.clock, self.durations, self.total = clock, list(durations), total
    self.kv: dict[str, str] = {}
    self.events: list = []         # (time, replica, post): posts not yet made
    self.next_round = [1] * len(durations)    # the next round message each replica reads
    self.posted = [False] * len(durations)    # waiting for a round it is in
    self.seq = [0] * len(durations)
    self.version = [0] * len(durations)
    self.messages: list[real.Message] = []     # every round message, as the replicas read it

  # --- the store ------------------------------------------------------------------------------

  def set(self, key, value):
    self.kv[key] = value
    if key.startswith("round/"):
      self._deliver()

  def try_get(self, key):
    return self.kv.get(key)

  def increment(self, key, by=1):
    n = int(self.kv.get(key, "0")) + by
    self.kv[key] = str(n)
    return n

  def wait(self, key, timeout_ms):
    """As `real.KeyValue.wait`: whole milliseconds, at least one; the clock moves here."""
    if key in self.kv:
      return self.kv[key]
    until = self.clock.now + max(1, int(timeout_ms)) / 1e3
    if until > HORIZON_S:
      raise TimeoutError(f"the run is stuck at {self.clock.now} s waiting for {key}")
    while self.events and self.events[0][0] <= until:
      t = self.events[0][0]
      self.clock.now = t
      while self.events and self.events[0][0] == t:     # every post made at this instant
        _, i, post = heapq.heappop(self.events)
        self._post(i, post)
      if key in self.kv:
        return self.kv[key]
    self.clock.now = until
    return None

  # --- the replicas ---------------------------------------------------------------------------

  def start(self, i):
    """Replica i claims the next microbatch and posts when it is done (at once, empty, once the
    stream is exhausted), as `RoundsReplica.next_round` does."""
    j = self.increment("claim") - 1
    samples, duration = MICROBATCH, self.durations[i]
    if j >= self.total:
      j, samples, duration = -1, 0, 0.0
    post = f"{i} {self.seq[i]} {self.version[i]} {samples} {j}"
    self.seq[i] += 1
    heapq.heappush(self.events, (self.clock.now + duration, i, post))

  def _post(self, i, post):
    self.kv[f"post/{self.increment('posts') - 1}"] = post
    self.posted[i] = True
    self._deliver()

  def _deliver(self):
    """Every waiting replica reads the rounds published so far; a member starts again."""
    members = []
    for i in range(len(self.durations)):
      while self.posted[i] and f"round/{self.next_round[i]}" in self.kv:
        msg = real.Message.from_json(self.kv[f"round/{self.next_round[i]}"])
        if self.next_round[i] > len(self.messages):
          self.messages.append(msg)
        self.next_round[i] += 1
        if msg.done:
          self.posted[i] = False
        elif i in msg.members:
          self.posted[i] = False
          self.version[i] = msg.version
          members.append(i)
    for i in sorted(members):       # in replica order, as Timeline.start claims
      self.start(i)


@contextlib.contextmanager
def simulated(clock):
  """`real` reads the time from `clock`."""
  saved = real.time
  real.time = clock
  try:
    yield
  finally:
    real.time = saved


def coordinate(durations, mode="ssaw", steps=4, known=True, cut_every=0, **kw):
  """(every message the coordinator published, the job) of a run whose replica r takes
  durations[r] seconds per microbatch; `known`: the coordinator starts knowing those durations
  (else it learns them from the first arrivals); a cut every `cut_every` samples."""
  clock = Clock()
  r = len(durations)
  job = Job(clock, durations, steps * r)
  settings = settings_lib.SyncSettings(mode=mode, **kw)
  coordinator = real.Coordinator(job, settings, r, batch_size=r * MICROBATCH,
                                 total_microbatches=steps * r, learning_rate=learning_rate,
                                 eval_every_samples=2 * r * MICROBATCH,
                                 checkpoint_every_samples=cut_every)
  if known:
    for rep, d in zip(coordinator.replicas, durations):
      rep.estimate_s = d
  for i in range(r):
    job.start(i)
  with simulated(clock):
    coordinator.start()
    coordinator.join()
  return coordinator.rounds, job


def as_round(msg, previous_close):
  """A published round as `Timeline.Round` (members without a microbatch left out)."""
  keep = [k for k, j in enumerate(msg.microbatches) if j >= 0]
  pick = lambda xs: tuple(xs[k] for k in keep)
  return timeline_lib.Round(msg.version, previous_close, msg.elapsed_s, pick(msg.members),
                            pick(msg.microbatches), pick(msg.staleness),
                            (MICROBATCH,) * len(keep))


def assert_same_rounds(durations, mode="ssaw", steps=4, **kw):
  """The coordinator publishes Timeline's rounds, each with the weights and learning-rate
  factor the module docs define, then "done" (which every replica read)."""
  messages, job = coordinate(durations, mode, steps, **kw)
  expected = timeline_rounds(durations, mode, steps, MICROBATCH, **kw)
  *rounds, done = messages
  assert done.done and done.version == len(rounds)
  assert done.samples == steps * len(durations) * MICROBATCH
  assert job.messages == messages             # what the replicas read is what was published
  closes = [0.0] + [m.elapsed_s for m in rounds]
  assert [as_round(m, c) for m, c in zip(rounds, closes)] == expected
  settings = settings_lib.SyncSettings(mode=mode, **kw)
  applied = 0
  for m, rnd in zip(rounds, expected):
    n = np.asarray(rnd.samples, float)
    discount = (np.ones(len(n)) if mode == "async" else
                (1.0 + np.asarray(rnd.staleness, float)) ** -settings.staleness_power)
    w = dict(zip(rnd.members, n * discount / np.sum(n * discount)))
    np.testing.assert_allclose(m.weights, [w.get(i, 0.0) for i in m.members], rtol=1e-12)
    at_count = learning_rate(m.version - 1)
    batches = applied / (MICROBATCH * len(durations))
    factor = 1.0 if at_count == 0 else learning_rate(batches) / at_count
    assert m.lr_factor == pytest.approx(factor, rel=1e-12)
    applied += int(n.sum())
    assert m.samples == applied
  return rounds


def test_message_round_trip():
  msg = real.Message(version=7, members=(0, 2, 3), weights=(0.5, 0.0, 0.5), lr_factor=0.75,
                     source=2, join=True, samples=40, elapsed_s=12.5, snapshot=True,
                     staleness=(1, 0, 2), microbatches=(9, -1, 11), done=False)
  text = msg.to_json()
  assert json.loads(text) == {"version": 7, "members": [0, 2, 3], "weights": [0.5, 0.0, 0.5],
                              "lr_factor": 0.75, "source": 2, "join": True, "samples": 40,
                              "elapsed_s": 12.5, "snapshot": True, "staleness": [1, 0, 2],
                              "microbatches": [9, -1, 11], "done": False,
                              "checkpoint": False, "stop": False}
  back = real.Message.from_json(text)
  assert back == msg and isinstance(back.members, tuple) and hash(back) == hash(msg)
  assert real.Message.from_json(real.Message(done=True).to_json()).done


def test_equal_speeds_make_synchronous_steps():
  rounds = assert_same_rounds([1.0, 1.0, 1.0], steps=4)
  assert [m.members for m in rounds] == [(0, 1, 2)] * 4
  assert [m.microbatches for m in rounds] == [(0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 10, 11)]
  assert [m.elapsed_s for m in rounds] == [1.0, 2.0, 3.0, 4.0]
  assert all(m.weights == (1 / 3,) * 3 and m.lr_factor == 1.0 for m in rounds)
  assert [m.join for m in rounds] == [False] * 4


def test_the_grace_deadline_decides_who_is_waited_for():
  # Replica 0 arrives at 1.0 after 1.0 s: the deadline is 1.0 + grace x 1.0.
  # (steps=2: with the stream exhausted, every round waits for everyone anyway)
  inside = assert_same_rounds([1.0, 1.25], steps=2, grace=0.25)      # arrives at the deadline
  assert (inside[0].members, inside[0].elapsed_s) == ((0, 1), 1.25)
  outside = assert_same_rounds([1.0, 1.25], steps=2, grace=0.125)    # 1/8 s after it
  # replica 1, late, is applied with replica 0's next (fresh) arrival, one update stale
  assert [(m.members, m.elapsed_s, m.staleness) for m in outside[:2]] == [
      ((0,), 1.0, (0,)), ((0, 1), 2.0, (0, 1))]
  assert outside[1].join          # and gets the current state from replica 0
  # async has no grace: the round closes at the first fresh arrival
  assert assert_same_rounds([1.0, 1.25], "async", steps=2)[0].members == (0,)


def test_an_unknown_replica_is_waited_for_until_the_deadline():
  # Until replica 1 (3 s a microbatch) has arrived once, the coordinator cannot know it will
  # miss the deadline: rounds without it close at the deadline (1 s + 0.25 x 1 s, then
  # 2.25 s + 0.25 x 1 s); once it is known, at replica 0's arrivals (4.5 s, 5.5 s).
  rounds, _ = coordinate([1.0, 3.0], steps=4, known=False, grace=0.25)
  assert [(m.members, m.elapsed_s) for m in rounds[:-1]] == [
      ((0,), 1.25), ((0,), 2.5), ((0, 1), 3.5), ((0,), 4.5), ((0,), 5.5), ((0, 1), 6.5)]
  known, _ = coordinate([1.0, 3.0], steps=4, grace=0.25)
  assert [m.elapsed_s for m in known[:2]] == [1.0, 2.0]


def test_the_staleness_bound_makes_the_fast_wait():
  rounds = assert_same_rounds([1.0, 1.0, 8.0], steps=8, staleness_bound=2)
  # Without the bound the slow replica would arrive 7 updates late; with it, the third round
  # waits for it: it closes at 8 s, not 3 s.
  assert rounds[2].elapsed_s == 8.0 and 2 in rounds[2].members
  assert max(s for m in rounds for s in m.staleness) == 2
  assert rounds[2].join          # the slow replica gets the current state from the others


def test_sync_waits_for_the_slowest_every_round():
  rounds = assert_same_rounds([1.0, 3.0], "sync", steps=3)
  assert [(m.members, m.elapsed_s) for m in rounds] == [((0, 1), 3.0), ((0, 1), 6.0),
                                                        ((0, 1), 9.0)]


def test_the_end_of_the_stream_waits_for_everyone():
  rounds = assert_same_rounds([1.0, 1.0, 2.5], steps=2)
  # Replica 2 (2.5 s) holds microbatch 2 while the fast two take the other five: the last round
  # waits for it (2 updates stale); replica 1, out of work, is in it with an empty post.
  last = rounds[-1]
  assert (last.members, last.microbatches, last.staleness) == ((0, 1, 2), (5, -1, 2), (0, 0, 2))
  assert last.weights[1] == 0.0 and last.snapshot and last.samples == 12


def test_a_cut_waits_for_every_replica_once_the_samples_reach_a_multiple():
  # Replica 1 takes 3 s a microbatch, replica 0 one: without cuts replica 0 runs ahead in rounds
  # of its own. A cut every 8 samples (4 microbatches): once the samples applied reach 8, the
  # next round waits for replica 1 and holds both; after it no gradient is in flight.
  free, _ = coordinate([1.0, 3.0], steps=8, grace=0.25)
  rounds, _ = coordinate([1.0, 3.0], steps=8, grace=0.25, cut_every=8)
  assert not any(m.checkpoint for m in free)
  cuts = [m for m in rounds if m.checkpoint]
  assert cuts and all(m.members == (0, 1) for m in cuts)
  before = [m.samples for m in rounds if not m.done]
  for cut in cuts:
    i = rounds.index(cut)
    previous = rounds[i - 1].samples if i else 0
    # the cut is the first round after the samples reached a multiple of 8
    assert previous >= 8 and previous // 8 > max([0] + [c.samples // 8 for c in cuts
                                                         if c.version < cut.version])
    assert cut.microbatches[1] >= 0 and cut.staleness[0] == 0   # replica 1 brought its gradient
  assert before != [m.samples for m in free if not m.done]      # the cuts changed the rounds
  applied = sorted(j for m in rounds for j in m.microbatches if j >= 0)
  assert applied == list(range(16))                             # every microbatch once
  assert rounds[-1].done and rounds[-1].samples == 32


@pytest.mark.parametrize("at_end", [False, True])
def test_a_stop_request_makes_the_next_round_a_cut_and_ends_the_rounds(at_end):
  clock = Clock()
  job = Job(clock, [1.0, 3.0], 8 if not at_end else 2)
  coordinator = real.Coordinator(job, settings_lib.SyncSettings(mode="ssaw", grace=0.25), 2,
                                 batch_size=2 * MICROBATCH, total_microbatches=job.total,
                                 learning_rate=learning_rate,
                                 eval_every_samples=2 * MICROBATCH)
  job.kv["stop"] = "1"            # a process heard a SIGTERM
  for i in range(2):
    job.start(i)
  with simulated(clock):
    coordinator.start()
    coordinator.join()
  if at_end:                      # every microbatch is claimed already: the run just finishes
    assert [m.stop for m in coordinator.rounds] == [False, False]
    assert coordinator.rounds[-1].done
    return
  (cut,) = coordinator.rounds     # replica 1 was waited for; nothing after the cut
  assert cut.checkpoint and cut.stop and cut.members == (0, 1) and cut.elapsed_s == 3.0
  assert cut.microbatches == (0, 1) and cut.samples == 2 * MICROBATCH


def test_a_resumed_coordinator_continues_from_its_cut():
  clock, r = Clock(), 2
  job = Job(clock, [1.0, 1.0], 4 * r)
  resume = real.Resume(version=5, applied=12, elapsed_s=30.0, next_eval=16, next_cut=20)
  job.kv["claim"] = str(12 // MICROBATCH)           # as the resumed run sets it
  coordinator = real.Coordinator(job, settings_lib.SyncSettings(mode="ssaw"), r,
                                 batch_size=r * MICROBATCH, total_microbatches=4 * r,
                                 learning_rate=learning_rate,
                                 eval_every_samples=2 * r * MICROBATCH,
                                 checkpoint_every_samples=8, resume=resume)
  job.version = [5, 5]
  for i in range(r):
    job.start(i)
  with simulated(clock):
    coordinator.start()
    coordinator.join()
  *rounds, done = coordinator.rounds
  assert [m.version for m in rounds] == [6]
  assert rounds[0].microbatches == (6, 7) and rounds[0].samples == 16
  assert rounds[0].elapsed_s == pytest.approx(31.0)     # the seconds before the cut count
  assert rounds[0].snapshot                              # the evaluation it was due for
  assert done.done and done.version == 6 and done.samples == 16
  assert coordinator.resume_point() == real.Resume(6, 16, 31.0, 24, 20)


def test_a_failure_ends_the_run_and_tells_the_replicas():
  clock = Clock()
  job = Job(clock, [1.0, 1.0], 4)
  coordinator = real.Coordinator(job, settings_lib.SyncSettings(mode="ssaw"), 2,
                                 batch_size=4, total_microbatches=4,
                                 learning_rate=learning_rate, eval_every_samples=4)
  job.kv["post/0"] = "0 0 0 2"        # a post missing its microbatch field
  with simulated(clock), pytest.raises(RuntimeError, match="coordinator failed") as info:
    coordinator.start()
    coordinator.join()
  assert isinstance(info.value.__cause__, ValueError)
  assert real.Message.from_json(job.kv["round/1"]).done      # the replicas stop waiting
  assert coordinator.rounds == []


HAND_PICKED = [
    ([1.0, 1.0, 1.0, 2.0], "ssaw", {}),
    ([1.0, 2.5, 1.0, 4.0], "ssaw", {"staleness_bound": 1}),
    ([1.0, 1.125, 1.0], "ssaw", {"grace": 0.25}),
    ([1.0, 1.125, 1.0], "async", {}),
    ([0.5, 3.0], "ssaw", {"staleness_bound": 0}),
    ([0.75, 1.5, 3.0], "ssaw", {"staleness_bound": 3, "grace": 0.5}),
]


@pytest.mark.parametrize("durations,mode,kw", HAND_PICKED)
def test_the_rounds_are_the_timelines(durations, mode, kw):
  assert_same_rounds(durations, mode, steps=5, **kw)


# Durations and grace are dyadic, so deadlines and arrivals are exact in floating point and a
# tie is a tie for both.
@hypothesis_settings(max_examples=60, deadline=None, derandomize=True)
@given(durations=st.lists(st.sampled_from([0.5, 1.0, 1.0, 1.25, 2.0, 3.75]), min_size=2,
                          max_size=4),
       mode=st.sampled_from(["ssaw", "async", "sync"]), bound=st.integers(0, 3),
       grace=st.sampled_from([0.0, 0.25, 0.5]), steps=st.integers(1, 4))
def test_generated_rounds_are_the_timelines(durations, mode, bound, grace, steps):
  assert_same_rounds(durations, mode, steps, staleness_bound=bound, grace=grace)

