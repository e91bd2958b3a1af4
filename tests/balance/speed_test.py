"""The speed sources on synthetic inputs: scheduler statistics written to a fake /proc and the
tracker's smoothing, each against numbers worked out by hand; then the sampler that wires
`balance.measure`, `probe_size`, `probe_repeats`, `probe_every` and `speed_alpha` into them
(the probe itself: probe_test.py)."""

import shutil
import types

import jax
import numpy as np
import pytest

from semijax.balance import probe as probe_lib
from semijax.balance import sampling
from semijax.balance import settings as settings_lib
from semijax.balance import speed
from semijax.core import emulation


def fake_devices(*ids):
  return [types.SimpleNamespace(id=i) for i in ids]


def write_schedstat(root, threads):
  """/proc/self/task as `root`: {thread id: (ns on a CPU, ns waiting, timeslices)}."""
  for tid, fields in threads.items():
    task = root / str(tid)
    task.mkdir(exist_ok=True)
    (task / "schedstat").write_text(" ".join(str(v) for v in fields) + "\n")


@pytest.fixture
def proc(tmp_path, monkeypatch):
  root = tmp_path / "task"
  root.mkdir()
  monkeypatch.setattr(speed.SchedShare, "PATH", str(root))
  return root


def test_sched_share_is_cpu_time_over_runnable_time_between_readings(proc):
  # Two threads; the third field (timeslices) is large so that reading it in place of either
  # time would change every answer. Thread 9 has no schedstat (it just ended): skipped.
  write_schedstat(proc, {7: (1_000, 500, 10 ** 9), 8: (2_000, 0, 10 ** 9)})
  (proc / "9").mkdir()
  assert speed.SchedShare.available()
  share = speed.SchedShare(fake_devices(3, 5))
  # Window 1: on += 4000 + 2000, waiting += 1000 + 1000: share 6000 / 8000 = 0.75.
  write_schedstat(proc, {7: (5_000, 1_500, 7), 8: (4_000, 1_000, 7)})
  assert share.measure() == {3: pytest.approx(4 / 3, rel=1e-12),
                             5: pytest.approx(4 / 3, rel=1e-12)}
  # Window 2 starts where window 1 ended. Thread 8 ended (its time in the window is unknown:
  # it counts as neither), thread 10 is new (it counts from zero): on += 1000 + 1000, waiting
  # += 3000 + 5000: share 2000 / 10000.
  write_schedstat(proc, {7: (6_000, 4_500, 1), 10: (1_000, 5_000, 1)})
  shutil.rmtree(proc / "8")
  assert share.measure() == {3: pytest.approx(5.0, rel=1e-12), 5: pytest.approx(5.0, rel=1e-12)}
  # Nothing ran or waited since: the share of an empty window is 1.
  assert share.measure() == {3: 1.0, 5: 1.0}
  # warm_up restarts the window: only what follows it counts (on 1000, waiting 3000).
  write_schedstat(proc, {7: (7_000, 5_500, 1), 10: (1_000, 6_000, 1)})
  share.warm_up()
  write_schedstat(proc, {7: (8_000, 8_500, 1), 10: (1_000, 6_000, 1)})
  assert share.measure()[5] == pytest.approx(4.0, rel=1e-12)


def test_sched_share_is_floored_and_unavailable_without_counters(proc, tmp_path, monkeypatch):
  write_schedstat(proc, {7: (1_000, 0, 1)})
  share = speed.SchedShare(fake_devices(0))
  write_schedstat(proc, {7: (1_001, 10 ** 9, 1)})      # share 1e-6: reported as 1 / 1e-3
  assert share.measure() == {0: pytest.approx(1e3)}
  write_schedstat(proc, {7: (0, 0, 1)})                 # counters that never ran
  assert not speed.SchedShare.available()
  monkeypatch.setattr(speed.SchedShare, "PATH", str(tmp_path / "missing"))
  assert not speed.SchedShare.available()


def test_tracker_smooths_a_regime_with_speed_alpha_in_log_space():
  # Speeds inside the threshold move the regime by a weighted geometric mean: the old level
  # with weight 1 - alpha, the new sample with alpha, then the fastest is 1 again.
  t = speed.SpeedTracker(3, alpha=0.25, threshold=0.5)
  assert t.update([1.0, 2.0, 1.25], 0.0)
  np.testing.assert_allclose(t.speeds, [1.0, 0.5, 0.8])
  assert not t.update([1.25, 2.0, 1.0], 1.0)      # raw speeds (0.8, 0.5, 1.0)
  mixed = np.array([1.0 ** 0.75 * 0.8 ** 0.25, 0.5 ** 0.75 * 0.5 ** 0.25, 0.8 ** 0.75])
  np.testing.assert_allclose(t.speeds, mixed / mixed.max(), rtol=1e-12)
  # alpha = 1: the regime is the last sample.
  t = speed.SpeedTracker(2, alpha=1.0, threshold=0.5)
  t.update([1.0, 1.5], 0.0)
  t.update([1.0, 1.25], 1.0)
  np.testing.assert_allclose(t.speeds, [1.0, 0.8], rtol=1e-12)
  with pytest.raises(ValueError, match="balance.speed_alpha"):
    speed.SpeedTracker(2, alpha=0.0)


# --- the sampler: which source, how often, with which settings ------------------------------


def mesh_2x4():
  """(data 2, tensor 4) over the first 8 devices, position (d, t) = device 4 d + t."""
  devices = np.array(jax.devices()[:8]).reshape(2, 4)
  return jax.sharding.Mesh(devices, ("data", "tensor")), devices


def test_probe_sampler_uses_the_probe_settings_and_the_slowest_replica(monkeypatch):
  settings = settings_lib.BalanceSettings(measure="auto", probe_every=2, probe_size=6,
                                          probe_repeats=2, probe_window=1,
                                          speed_alpha=0.25, change_threshold=0.3).validate()
  monkeypatch.setattr(speed.SchedShare, "available", classmethod(lambda cls: False))
  mesh, grid = mesh_2x4()
  block = probe_lib.ProbeShape(rows=32, d_model=8, width=4)
  s = sampling.SpeedSampler(settings, emulation.Hetero(), mesh, block)
  assert s.measure == "probe" and s.every == 2
  assert s.probe.shape == probe_lib.ProbeShape.square(6) and s.probe.repeats == 2
  s.warm_up()
  assert sorted(s.probe.measure()) == sorted(d.id for d in s.probe.devices)
  waiting = s.probe._pool
  assert waiting is not None                       # 8 local devices: a thread waits for each
  s.close()                                        # the balancer's close ends them
  assert s.probe._pool is None and waiting._shutdown
  # Probe seconds per mesh position (data row, tensor column), for the barrier and 2 samples.
  rows = [np.ones((2, 4)),
          np.array([[1.0, 1.0, 1.0, 2.0], [1.0, 1.5, 1.0, 1.0]]),
          np.array([[1.0, 1.6, 1.0, 1.0], [1.0, 1.0, 1.0, 2.2]])]
  by_id = [{int(d.id): float(t) for d, t in zip(grid.ravel(), r.ravel())} for r in rows]
  monkeypatch.setattr(s.probe, "measure", iter(by_id).__next__)
  s.start()
  first = s.after_step(0, 0.1)
  np.testing.assert_allclose(first.times, [1.0, 1.5, 1.0, 2.0])   # slowest of each column
  assert first.new_regime and first.mean_s == pytest.approx(0.1)
  assert s.after_step(1, 0.2) is None                             # probe_every = 2
  second = s.after_step(2, 0.4)
  np.testing.assert_allclose(second.times, [1.0, 1.6, 1.0, 2.2])
  assert not second.new_regime
  assert second.mean_s == pytest.approx(0.3) and second.clock_s == pytest.approx(0.7)
  # Within the threshold: smoothed with alpha 0.25 (weighted geometric mean of speeds).
  old, new = np.array([1, 1 / 1.5, 1, 1 / 2.0]), np.array([1, 1 / 1.6, 1, 1 / 2.2])
  np.testing.assert_allclose(s.tracker.speeds, old ** 0.75 * new ** 0.25, rtol=1e-12)
  assert s.samples == 2
  # probe_size 0 (the default): the model's block; without its shape the sampler cannot probe.
  default = settings_lib.BalanceSettings(measure="probe", probe_every=2).validate()
  assert sampling.SpeedSampler(default, emulation.Hetero(), mesh, block).probe.shape == block
  with pytest.raises(ValueError, match="^balance.probe_size: 0 probes the model's block"):
    sampling.SpeedSampler(default, emulation.Hetero(), mesh)


def test_the_probe_is_sized_to_its_budget_and_its_speeds_are_a_windowed_median(monkeypatch):
  settings = settings_lib.BalanceSettings(measure="probe", probe_every=2, probe_size=6,
                                          probe_budget=0.1, probe_window=3).validate()
  mesh, grid = mesh_2x4()
  s = sampling.SpeedSampler(settings, emulation.Hetero(), mesh)
  assert s.probe.repeats == 1                      # probe_repeats 0: sized by the first sample
  ids = [int(d.id) for d in grid.ravel()]
  passes = {i: 0.002 for i in ids}
  passes[ids[5]] = 0.004                           # the slowest device's pass sets the count
  monkeypatch.setattr(s.probe, "pass_seconds", lambda: passes)
  column_3 = iter([3.0, 2.0, 1.0, 2.0, 1.0, 1.0])  # tensor position 3's time (others 1.0)
  monkeypatch.setattr(s.probe, "measure", lambda: {i: (next(column_3) if i == ids[3] else 1.0)
                                                   for i in ids})
  assert s.describe() == "probe, passes sized at the first sample, every 2 steps"
  assert s.passes is None
  # The trial (warm-up) sample: 0.1 of 2 steps of 0.12 s = 24 ms, at 4 ms a pass: 6 passes.
  trial = s.trial(0, 0.12)
  assert s.probe.repeats == 6
  assert s.describe() == "probe, 6 passes, every 2 steps" and s.passes == 6
  np.testing.assert_allclose(trial.times, [1, 1, 1, 3])
  got = []
  for step in range(0, 10, 2):
    got.append(s.after_step(step, 0.1))
    assert s.probe.repeats == 6                    # sized once
  # Warm-up's sample left the window: the first training sample's median is its own.
  np.testing.assert_allclose([g.times[3] for g in got], [2.0, 1.5, 2.0, 1.0, 1.0])
  np.testing.assert_allclose([g.raw_speeds[3] for g in got], [0.5, 1, 0.5, 1, 1])
  np.testing.assert_allclose(got[2].speeds, [1, 1, 1, 0.5])   # one fast reading is outvoted


def test_sched_sampler_reports_the_process_share_on_every_device(proc, monkeypatch):
  write_schedstat(proc, {1: (1_000, 1_000, 3)})
  settings = settings_lib.BalanceSettings(measure="auto", probe_every=1).validate()
  mesh, _ = mesh_2x4()
  s = sampling.SpeedSampler(settings, emulation.Hetero(), mesh)
  assert s.measure == "sched" and isinstance(s.probe, speed.SchedShare)
  write_schedstat(proc, {1: (4_000, 2_000, 3)})        # share 3000 / 4000
  s.start()
  write_schedstat(proc, {1: (5_000, 6_000, 3)})        # share 1000 / 5000
  sample = s.after_step(0, 0.5)
  np.testing.assert_allclose(sample.times, [5.0] * 4)  # one process: its devices share its cores
  np.testing.assert_allclose(sample.speeds, [1.0] * 4)
