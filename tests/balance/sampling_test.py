"""Speed sampling and the decision log, without an engine."""

import types

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
