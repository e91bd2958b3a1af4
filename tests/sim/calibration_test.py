"""The simulator against this machine's measured runs (stored in benchmarks/measurements/).

The replays use the committed constants (`experiments/calibrate_sim.py` fits them from the same
files). Emulated runs (a host sleep on 8 fake devices) are deterministic: step times and every
throughput ratio must be within 10%. Real-contention runs (2 processes, a CPU-bound competitor)
are single noisy runs: their step times and ratios to `even` must be within 10%; ratios to the
oracle are within 20% (the oracle's measured runs are 6-10% faster than predicted under
contention; see the README's simulator section).
"""

import dataclasses
import os

import numpy as np
import pytest

from helpers import ROOT
from semijax.errors import ConfigError
from semijax.sim import calibrate
from semijax.sim import hardware
from semijax.sim import simulator
from semijax.sim import traces

MEASUREMENTS = os.path.join(ROOT, "benchmarks", "measurements")
CONSTANTS = os.path.join(MEASUREMENTS, "sim_constants.json")
TOLERANCE = 0.10
ORACLE_TOLERANCE_REAL = 0.20


@pytest.fixture(scope="module")
def stored():
  return calibrate.load_measurements(MEASUREMENTS), hardware.load(CONSTANTS)


def test_emulated_replays_are_within_ten_percent(stored):
  measurements, constants = stored
  rows = calibrate.check(measurements["emulated"], constants.profile(calibrate.EMULATED))
  assert len(rows) == 12
  for x in rows:
    for key in ("step_error", "vs_even_error", "vs_oracle_error"):
      assert abs(x[key]) <= TOLERANCE, (x["scenario"], x["policy"], key, x[key])


def test_real_contention_replays_are_within_ten_percent(stored):
  measurements, constants = stored
  params = constants.fit["profiles"][calibrate.REAL]["params"]
  rows = calibrate.check(measurements["real"], constants.profile(calibrate.REAL),
                         contention_speed=params["contention_speed"])
  assert len(rows) == 18
  lo, hi = params["contention_speed_range"]
  assert lo <= params["contention_speed"] <= hi       # inside what the controllers measured
  for x in rows:
    assert abs(x["step_error"]) <= TOLERANCE, (x["scenario"], x["policy"], x["step_error"])
    assert abs(x["vs_even_error"]) <= TOLERANCE, (x["scenario"], x["policy"], x["vs_even_error"])
    assert abs(x["vs_oracle_error"]) <= ORACLE_TOLERANCE_REAL, (x["scenario"], x["policy"])


def test_the_stored_constants_are_the_fit_of_the_stored_measurements(stored):
  # (At the stored contention speed: the search over speeds is the calibration command's.)
  measurements, constants = stored
  speed = constants.fit["profiles"][calibrate.REAL]["params"]["contention_speed"]
  fitted, params = calibrate.fit(measurements, contention_speeds=[speed])
  for name, hw in fitted.items():
    want = constants.profile(name)
    for field in ("device_flops", "step_overhead_s", "branch_overhead", "resize_overhead",
                  "offload_overhead", "move_fixed_s", "sample_s", "step_noise"):
      assert getattr(hw, field) == pytest.approx(getattr(want, field), rel=1e-6, abs=1e-12), field
  assert params[calibrate.REAL]["contention_speed"] == pytest.approx(
      constants.fit["profiles"][calibrate.REAL]["params"]["contention_speed"])


def test_the_fit_recovers_known_constants():
  # Measurements made by the simulator itself with known constants: the fit finds them again.
  measured = calibrate.load_measurements(MEASUREMENTS)["real"]
  truth = hardware.Hardware("truth", device_flops=5e10, branch_overhead=0.3,
                            resize_overhead=0.4, offload_overhead=0.6, step_overhead_s=0.02,
                            move_fixed_s=0.2)
  synthetic = dict(measured, records=[])
  for rec in measured["records"]:
    r = calibrate.replay(measured, rec, truth)
    synthetic["records"].append(dict(rec, step_times_s=r.step_s.tolist()))
  start = dataclasses.replace(truth, device_flops=1e10, branch_overhead=0.0, resize_overhead=0.0,
                              offload_overhead=0.0, step_overhead_s=0.0)
  got = calibrate.fit_steps(synthetic, start)
  # The decisions make the fit's fixed point depend on where it starts (see `fit_steps`): the
  # constants it finds explain the measurements, and are near the true ones.
  # (A run whose decision comes a few steps earlier or later can differ by 10%.)
  errors = [calibrate.replay(synthetic, rec, got).step_s.mean() / np.mean(rec["step_times_s"]) - 1
            for rec in synthetic["records"]]
  assert np.mean(np.abs(errors)) < 0.03 and np.max(np.abs(errors)) < 0.15
  assert got.device_flops == pytest.approx(5e10, rel=0.15)
  assert got.step_overhead_s == pytest.approx(0.02, abs=0.015)


def test_nnls_keeps_coefficients_non_negative():
  rng = np.random.default_rng(0)
  a = rng.random((20, 3))
  b = a @ np.array([2.0, -1.0, 0.5])
  x = calibrate.nnls(a, b)
  assert (x >= 0).all()
  assert np.linalg.norm(a @ x - b) <= np.linalg.norm(b)


def test_the_constants_file_round_trips_and_refuses_bad_fields(tmp_path, stored):
  _, constants = stored
  path = tmp_path / "c.json"
  hardware.save(constants, str(path))
  again = hardware.load(str(path))
  assert again.profiles == constants.profiles
  bad = constants.to_json()
  bad["profiles"]["cpu_2proc"]["device_flops"] = -1
  with pytest.raises(ConfigError, match="sim.profiles.cpu_2proc.device_flops: must be a positive"):
    hardware.parse(bad)
  bad = constants.to_json()
  bad["profiles"]["cpu_2proc"]["links"] = {"moon": {"latency_s": 1.0}}
  with pytest.raises(ConfigError, match="sim.profiles.cpu_2proc.links.moon: unknown level"):
    hardware.parse(bad)
  with pytest.raises(ConfigError, match="sim.hardware: 'tpu' is not one of"):
    constants.profile("tpu")


def test_a_replay_trace_holds_the_measured_contention(stored):
  measurements, _ = stored
  real = measurements["real"]
  rec = next(r for r in real["records"] if r["scenario"] == "bursts")
  t = calibrate.trace_of(real, rec, 0.4)
  (on, off), = rec["contention"]
  assert t.at(0, on + 0.01)[0].tolist() == [1.0, 0.4]
  assert t.at(0, off + 0.01)[0].tolist() == [1.0, 1.0]
  assert isinstance(t, traces.Trace) and isinstance(calibrate.run_of(real, rec, hardware.Hardware(
      "x", device_flops=1e10)), simulator.Run)
