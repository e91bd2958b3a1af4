"""Speed sampling and the decision log, without an engine."""

import json
import types

import jax
import numpy as np
import pytest

from semijax.balance import decisions
from semijax.balance import sampling
from semijax.balance import settings as settings_lib
from semijax.balance import speed
from semijax.core import emulation

MESH = types.SimpleNamespace(shape={"data": 1, "tensor": 4})


def sampler(**kw):
  hetero = emulation.Hetero((4.0, 1.0, 1.0, 1.0), rotate_every=kw.pop("rotate_every", 0))
  return sampling.SpeedSampler(settings_lib.BalanceSettings(**kw), hetero, MESH)


def test_emulated_samples_every_step_with_a_shared_clock():
  s = sampler(confirm=2)
  assert s.measure == "emulated" and s.every == 1
  assert s.describe() == "emulated, every step"
  first = s.after_step(0, 0.5)
  assert first.new_regime and first.mean_s == 0.5 and first.clock_s == 0.5
  np.testing.assert_allclose(first.speeds, [0.25, 1, 1, 1])
  second = s.after_step(1, 0.3)
  assert not second.new_regime and second.clock_s == pytest.approx(0.8)
  # The smoothed step time: 0.7 * 0.5 + 0.3 * 0.3.
  assert s.step_s == pytest.approx(0.7 * 0.5 + sampling.STEP_TIME_ALPHA * 0.3)
  # The regime began at the first sample (clock 0.5): 0.3 s so far, at least MIN_EXPECTED_S.
  assert s.expected_remaining_s() == speed.MIN_EXPECTED_S
  s.after_step(2, 1.7)
  assert s.expected_remaining_s() == pytest.approx(2.0)      # as long as it has lasted


def test_a_rotating_profile_makes_new_regimes():
  s = sampler(confirm=2, rotate_every=3)
  got = [s.after_step(step, 0.1).new_regime for step in range(9)]
  # The slow device moves at steps 3 and 6; each move confirms after 2 samples.
  assert got == [True, False, False, False, True, False, False, True, False]
  np.testing.assert_allclose(s.tracker.speeds, [1, 1, 0.25, 1])


def test_measure_resolves_auto():
  assert sampling.resolve_measure("auto", emulation.Hetero((2.0, 1.0))) == "emulated"
  assert sampling.resolve_measure("probe", emulation.Hetero((2.0, 1.0))) == "probe"
  assert sampling.resolve_measure("auto", emulation.Hetero()) in ("sched", "probe")
  # The CPU share of the host's threads is a speed only for CPU devices: a GPU or TPU is probed.
  for backend in ("gpu", "tpu"):
    assert sampling.resolve_measure("auto", emulation.Hetero(), backend) == "probe", backend
  assert sampling.resolve_measure("auto", emulation.Hetero((2.0, 1.0)), "gpu") == "emulated"


def test_decision_log_writes_json_lines_and_closes(tmp_path):
  log = decisions.DecisionLog(str(tmp_path))
  log.write({"step": 1, "choice": "exact"})
  log.write({"step": 2, "choice": "migrate"}, flush=True)
  log.close()
  assert log.closed
  log.close()                                   # a second close does nothing
  assert [r["choice"] for r in decisions.read(str(tmp_path))] == ["exact", "migrate"]
  nowhere = decisions.DecisionLog(None)
  nowhere.write({"step": 1})
  assert nowhere.closed and decisions.read(str(tmp_path / "none")) == []


class FakeStore:
  """The key-value client of a 2-process job, with process 1's records already posted."""

  def __init__(self):
    self.kv = {}

  def key_value_set(self, key, value):
    self.kv[key] = value

  def blocking_key_value_get(self, key, timeout_ms):
    del timeout_ms
    if key.endswith("/1"):       # the other process: its device 1 took 3 s, its step 0.7 s
      return json.dumps([0.7, [[1, 3.0]]])
    return self.kv[key]

  def key_value_delete(self, key):
    del self.kv[key]


def test_key_value_gather_shares_every_process_record_and_cleans_up(monkeypatch):
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: 0)
  gather = sampling.KeyValueGather()
  gather.client = store = FakeStore()
  times, most = gather({0: 1.5}, 0.4)
  assert times == {0: 1.5, 1: 3.0} and most == 0.7
  assert json.loads(store.kv[f"{gather.prefix}0/0"]) == [0.4, [[0, 1.5]]]
  for _ in range(4):
    gather({0: 1.0}, 0.1)
  # Only this process's last `_KEEP` records stay in the store.
  assert sorted(store.kv) == [f"{gather.prefix}{i}/0" for i in (3, 4)]
  # One process (or too many for the store): the all-gather of `speed.gather_times`.
  monkeypatch.setattr(jax, "process_count", lambda: 1)
  assert sampling.KeyValueGather().client is None
  assert sampling.KeyValueGather()({0: 2.0}, 0.3) == ({0: 2.0}, 0.3)
  monkeypatch.setattr(jax, "process_count", lambda: sampling.KV_MAX_PROCESSES + 1)
  assert sampling.KeyValueGather().client is None
