"""Straggler scenarios: what each one does to the devices, deterministic, refused when wrong."""

import json

import numpy as np
import pytest

from semijax.errors import ConfigError
from semijax.sim import traces


def speeds_over(trace, times):
  trace.reset()
  return np.stack([trace.at(0, t)[0].copy() for t in times])


def test_none_keeps_every_device_at_full_speed():
  t = traces.build("none", None, num_devices=16, regions=1, duration_s=100.0)
  assert (speeds_over(t, [0.0, 50.0, 99.0]) == 1.0).all()


def test_persistent_slows_its_share_for_the_whole_run():
  t = traces.build("persistent", {"share": 0.25, "speed": 0.5}, num_devices=16, regions=1,
                   duration_s=100.0, seed=3)
  s = speeds_over(t, [0.0, 50.0, 99.0])
  assert (s == s[0]).all()
  assert sorted(np.unique(s[0]).tolist()) == [0.5, 1.0]
  assert (s[0] == 0.5).sum() == 4


def test_bursts_keep_about_their_busy_share_slow():
  t = traces.build("bursts", {"busy": 0.1, "mean_s": 5.0, "speed": 0.4}, num_devices=400,
                   regions=1, duration_s=2000.0, seed=0)
  s = speeds_over(t, np.linspace(100, 1900, 200))
  share = (s < 1.0).mean()
  assert 0.07 < share < 0.13
  assert set(np.unique(s).tolist()) == {0.4, 1.0}
  # Transient: a slow device recovers (no device slow at every instant).
  assert not (s < 1.0).all(axis=0).any()


def test_rotating_moves_the_straggler():
  t = traces.build("rotating", {"share": 1 / 8, "speed": 0.125, "period_s": 10.0},
                   num_devices=8, regions=1, duration_s=200.0, seed=1)
  s = speeds_over(t, np.arange(5.0, 200.0, 10.0))
  assert ((s == 0.125).sum(axis=1) == 1).all()                     # one straggler at a time
  assert len(set(np.argmin(s, axis=1).tolist())) > 3               # on different devices


def test_fail_slow_decays_to_its_floor_and_stays():
  t = traces.build("fail_slow", {"share": 0.5, "floor": 0.3, "decay_s": 20.0}, num_devices=4,
                   regions=1, duration_s=100.0, seed=2)
  s = speeds_over(t, np.arange(0.0, 100.0, 0.5))
  slow = np.nonzero(s[-1] < 1)[0]
  assert len(slow) == 2 and np.allclose(s[-1, slow], 0.3)
  for d in slow:
    assert (np.diff(s[:, d]) <= 0).all()                            # never recovers
    assert len(np.unique(s[:, d])) > 5                               # gradually


def test_fail_slow_1pct_drops_one_device_per_affected_replica_and_stays():
  # 32 replicas of 32 devices, a share 1/8 of them: 4 replicas, one device each at 0.01 from a
  # time in the first quarter of the run on.
  t = traces.build("fail_slow_1pct", None, num_devices=1024, regions=1, duration_s=100.0,
                   seed=5, replica_devices=32)
  s = speeds_over(t, np.arange(0.0, 100.0, 0.5)).reshape(-1, 32, 32)     # [time, replica, device]
  assert set(np.unique(s).tolist()) == {0.01, 1.0}
  assert (s[0] == 1.0).all()
  slow = (s[-1] == 0.01).sum(axis=1)
  assert sorted(slow.tolist()) == [0] * 28 + [1] * 4
  assert (s[np.arange(0.0, 100.0, 0.5) >= 25.0] == s[-1]).all()          # from its onset on
  onsets = t.events[:, 0]
  assert len(onsets) == 4 and (onsets < 25.0).all()
  # Few replicas: still one (shares round to at least one); one replica: all devices in it.
  two = traces.build("fail_slow_1pct", None, num_devices=64, regions=1, duration_s=10.0,
                     replica_devices=32)
  assert len(two.events) == 1 and two.events[0, 2] == 0.01
  one = traces.build("fail_slow_1pct", {"share": 1.0}, num_devices=8, regions=1, duration_s=1.0)
  assert len(one.events) == 1


def test_slow_link_cuts_region_bandwidth_in_its_window():
  t = traces.build("slow_link", {"factor": 0.1, "start": 0.25, "end": 0.75}, num_devices=8,
                   regions=2, duration_s=100.0)
  t.reset()
  links = [t.at(0, x)[1].copy() for x in (10.0, 30.0, 60.0, 80.0)]
  assert [lf.tolist() for lf in links] == [[1, 1], [0.1, 1], [0.1, 1], [1, 1]]
  with pytest.raises(ConfigError, match="sim.scenario.slow_link"):
    traces.build("slow_link", None, num_devices=8, regions=1, duration_s=100.0)


def test_the_same_seed_gives_the_same_trace():
  a = traces.build("bursts", None, num_devices=64, regions=1, duration_s=500.0, seed=7)
  b = traces.build("bursts", None, num_devices=64, regions=1, duration_s=500.0, seed=7)
  c = traces.build("bursts", None, num_devices=64, regions=1, duration_s=500.0, seed=8)
  assert np.array_equal(a.events, b.events) and not np.array_equal(a.events, c.events)


def test_replay_reads_a_trace_file(tmp_path):
  src = traces.build("rotating", {"period_s": 5.0, "share": 0.25}, num_devices=8, regions=2,
                     duration_s=50.0, seed=4)
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(src.to_json()))
  t = traces.build("replay", {"path": str(path)}, num_devices=8, regions=2, duration_s=1.0)
  times = np.linspace(0, 49, 30)
  assert np.array_equal(speeds_over(t, times), speeds_over(src, times))
  with pytest.raises(ConfigError, match="num_devices: the trace has 8 devices, the cluster 16"):
    traces.build("replay", {"path": str(path)}, num_devices=16, regions=2, duration_s=1.0)


def test_a_step_indexed_trace_follows_steps():
  t = traces.Trace(2, 1, [[3, 1, 0.5]], unit="step")
  assert [t.at(step, 1e9)[0][1] for step in range(5)] == [1, 1, 1, 0.5, 0.5]


@pytest.mark.parametrize("name, params, field", [
    ("storm", None, "sim.scenario: 'storm'"),
    ("bursts", {"rate": 1.0}, "sim.scenario.bursts.rate: unknown"),
    ("persistent", {"speed": 2.0}, "sim.scenario.persistent.speed: must be in"),
    ("bursts", {"mean_s": -1.0}, "sim.scenario.bursts.mean_s: must be a positive"),
    ("replay", None, "sim.scenario.replay.path"),
    ("fail_slow_1pct", {"speed": 0.0}, "sim.scenario.fail_slow_1pct.speed: must be a positive"),
    ("fail_slow_1pct", {"share": 2.0}, "sim.scenario.fail_slow_1pct.share: must be in"),
    ("fail_slow_1pct", {"onset": 1.5}, "sim.scenario.fail_slow_1pct.onset: must be in"),
    ("fail_slow_1pct", {"floor": 0.3}, "sim.scenario.fail_slow_1pct.floor: unknown"),
])
def test_bad_scenarios_are_refused_naming_the_field(name, params, field):
  with pytest.raises(ConfigError, match=field.replace("(", r"\(")):
    traces.build(name, params, num_devices=8, regions=1, duration_s=10.0)


@pytest.mark.parametrize("replica_devices", [3, 0, 16])
def test_replicas_that_do_not_divide_the_devices_are_refused(replica_devices):
  with pytest.raises(ConfigError, match="sim.trace.replica_devices"):
    traces.build("fail_slow_1pct", None, num_devices=8, regions=1, duration_s=10.0,
                 replica_devices=replica_devices)


def test_bad_trace_rows_are_refused():
  with pytest.raises(ConfigError, match="sim.trace.events: bad row"):
    traces.Trace(4, 1, [[0.0, 7, 0.5]])
  with pytest.raises(ConfigError, match="sim.trace.events: bad row"):
    traces.Trace(4, 1, [[0.0, 1, 0.0]])
