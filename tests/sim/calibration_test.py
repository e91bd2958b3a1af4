"""The simulator against this machine's measured runs (stored in benchmarks/measurements/).

The replays use the committed constants (`experiments/calibrate_sim.py` fits them from the same
files). Scripted replays take each run's own recorded decisions and check the costs: emulated
runs (a host sleep on 8 fake devices) and real-contention runs (2 processes, a CPU-bound
competitor) within 10% in step time and both throughput ratios (to `even` and to the static
oracle), except real runs that `calibrate.consistency` finds noisier than the tolerance (their
steps before any change differ from the same steps of `even` by more than 10%; none in the
stored benchmark). The real runs meet it with two terms of the step model that the fit finds
in them (`Hardware.idle_speedup`, `Hardware.contention_wait_s`): with the competitor off, an
uneven split costs what the even one does (the 2 processes share one physical core: the fast
one computes up to twice as fast while the slow one waits), and a contended step pays a wait
beyond its compute (the contended process wakes up late from the collectives); without them
the bursts oracle's uneven split was off by 12%. Replays in which the library's current
decision code decides are checked for the emulated runs; for the real ones they show what the
current controller would have done (see calibration.md).
"""

import dataclasses
import json
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


def _runs(measured: dict) -> int:
  """Scenarios x policies x rounds of a measured benchmark."""
  names = {(r["scenario"], r["policy"], r.get("round")) for r in measured["records"]}
  assert len(names) == len(measured["records"]) >= 12
  return len(names)


@pytest.fixture(scope="module")
def stored():
  return calibrate.load_measurements(MEASUREMENTS), hardware.load(CONSTANTS)


@pytest.mark.parametrize("scripted", [True, False])
def test_emulated_replays_are_within_ten_percent(stored, scripted):
  measurements, constants = stored
  rows = calibrate.check(measurements["emulated"], constants.profile(calibrate.EMULATED),
                         scripted=scripted)
  assert len(rows) == _runs(measurements["emulated"]) and not any(x["noisy"] for x in rows)
  for x in rows:
    for key in ("step_error", "vs_even_error", "vs_oracle_error"):
      assert abs(x[key]) <= TOLERANCE, (x["scenario"], x["policy"], key, x[key])


def test_real_contention_replays_are_within_ten_percent(stored):
  measurements, constants = stored
  params = constants.fit["profiles"][calibrate.REAL]["params"]
  rows = calibrate.check(measurements["real"], constants.profile(calibrate.REAL),
                         contention_speed=params["contention_speed"], scripted=True)
  assert len(rows) == _runs(measurements["real"])
  lo, hi = params["contention_speed_range"]
  assert lo <= params["contention_speed"] <= hi       # inside what the controllers measured
  assert len([x for x in rows if x["noisy"]]) <= 2
  for x in rows:
    if x["noisy"]:
      continue
    for key in ("step_error", "vs_even_error", "vs_oracle_error"):
      assert abs(x[key]) <= TOLERANCE, (calibrate.name(x), key, x[key])


def test_noisy_runs_are_those_that_disagree_with_even_on_the_same_steps(stored):
  measurements, _ = stored
  real = measurements["real"]
  twins = calibrate.consistency(real)
  checked = 0
  for run in real["records"]:
    if run["policy"] in ("even", "static", "offload"):
      continue
    even = next(r for r in real["records"] if r["scenario"] == run["scenario"]
                and r["policy"] == "even" and r["round"] == run["round"])   # same round's even
    first = run["decisions"][0]["step"] if run["decisions"] else len(run["step_times_s"])
    key = (run["scenario"], run["policy"], run["round"])
    if first < calibrate.MIN_IDENTICAL_STEPS:
      assert key not in twins                      # too few identical steps to judge
      continue
    want = np.mean(run["step_times_s"][:first]) / np.mean(even["step_times_s"][:first]) - 1
    assert twins[key] == pytest.approx(want)
    checked += 1
  assert checked == len(twins) > 0
  assert len(calibrate.consistent(real)["records"]) == len(real["records"]) - sum(
      abs(v) > calibrate.CONSISTENCY for v in twins.values())


def test_a_scripted_replay_takes_the_recorded_decisions(stored):
  measurements, constants = stored
  real = measurements["real"]
  rec = next(r for r in real["records"] if r["scenario"] == "steady" and r["policy"] == "migrate")
  r = calibrate.replay(real, rec, constants.profile(calibrate.REAL), scripted=True)
  (change,) = r.stages[0]["changes"]
  assert change["step"] == rec["decisions"][0]["step"] and change["owned"] == {
      k: list(v) for k, v in rec["decisions"][0]["owned"].items()}


def test_the_stored_constants_are_the_fit_of_the_stored_measurements(stored):
  # (At the stored contention speed: the search over speeds is the calibration command's.)
  measurements, constants = stored
  speed = constants.fit["profiles"][calibrate.REAL]["params"]["contention_speed"]
  fitted, params = calibrate.fit(measurements, contention_speeds=[speed])
  for name, hw in fitted.items():
    want = constants.profile(name)
    for field in ("device_flops", "step_overhead_s", "branch_overhead", "resize_overhead",
                  "offload_overhead", "idle_speedup", "contention_wait_s", "move_fixed_s",
                  "sample_s", "step_noise"):
      assert getattr(hw, field) == pytest.approx(getattr(want, field), rel=1e-6, abs=1e-12), field
  assert params[calibrate.REAL]["contention_speed"] == pytest.approx(
      constants.fit["profiles"][calibrate.REAL]["params"]["contention_speed"])


def test_the_fit_recovers_known_constants():
  # Measurements made by the simulator itself with known constants: the fit finds them again.
  measured = calibrate.load_measurements(MEASUREMENTS)["real"]
  truth = hardware.Hardware("truth", device_flops=5e10, branch_overhead=0.3,
                            resize_overhead=0.4, offload_overhead=0.6, step_overhead_s=0.02,
                            idle_speedup=1.5, contention_wait_s=0.03, move_fixed_s=0.2)
  synthetic = dict(measured, records=[])
  for rec in measured["records"]:
    r = calibrate.replay(measured, rec, truth, scripted=True)
    synthetic["records"].append(dict(rec, step_times_s=r.step_s.tolist()))
  start = dataclasses.replace(truth, device_flops=1e10, branch_overhead=0.0, resize_overhead=0.0,
                              offload_overhead=0.0, step_overhead_s=0.0, idle_speedup=1.0,
                              contention_wait_s=0.0)
  got = calibrate.fit_steps(synthetic, start)
  assert got.device_flops == pytest.approx(5e10, rel=0.01)
  assert got.step_overhead_s == pytest.approx(0.02, rel=0.02)
  assert got.idle_speedup == pytest.approx(1.5, rel=0.02)
  assert got.contention_wait_s == pytest.approx(0.03, rel=0.05)
  for field in ("branch_overhead", "resize_overhead", "offload_overhead"):
    assert getattr(got, field) == pytest.approx(getattr(truth, field), abs=0.01), field


def _straggler_output(root, rounds):
  """A tiny straggler benchmark output (real part: even and semi, scenarios none and steady):
  runs/S/P/roundR/ and lists of runs per cell, or with `rounds` None the format before rounds
  (runs/S/P/ and one run per cell)."""
  config = {"model": {"d_model": 8}, "batch_size": 4, "mesh": {"data": 1, "tensor": 2},
            "balance": {"probe_every": 2}, "resize": {}, "hetero": {"slowdown": []},
            "layout": {"mlp": "even"}}
  raw = {"config": config, "speeds": {"steady": [1.0, 0.4]}, "bursts": {"on_s": 4, "off_s": 4},
         "runs": {}}
  for scenario in ("none", "steady"):
    for policy in ("even", "semi"):
      cell = []
      for r in ([None] if rounds is None else range(rounds)):
        k = 0 if r is None else r
        slow = 1.2 if policy == "semi" and k == 1 else 1.0     # round 1's semi: before any change
        run = {"step_times_s": [slow * (0.1 + k)] * 6, "tokens_per_s": 100.0 + k,
               "migrations": k, "final_counts": {"mlp": [4, 4]},
               "contention": {"intervals": [[0.5, 9.0 + k]]} if scenario == "steady" else None}
        if r is not None:
          run["round"] = r
        cell.append(run)
        d = root / "runs" / scenario / policy
        d = d if r is None else d / f"round{r}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps(config))
        if policy == "semi":
          log = [{"step": s, "changed": s == 5, "owned": {"mlp": [5 + k, 3 - k]},
                  "computed": {"mlp": [5, 3]}, "keep": None, "sample_s": 0.01,
                  "speeds": [1.0, 0.4 + 0.1 * s], "cost": {"move_s": 0.2}} for s in (1, 3, 5)]
          (d / "decisions.jsonl").write_text("".join(json.dumps(x) + "\n" for x in log))
      raw["runs"].setdefault(scenario, {})[policy] = cell if rounds is not None else cell[0]
  (root / "real_raw.json").write_text(json.dumps(raw))


@pytest.mark.parametrize("rounds", [2, None])
def test_every_rounds_run_is_its_own_record(tmp_path, rounds):
  _straggler_output(tmp_path, rounds)
  got = calibrate.extract_real(str(tmp_path))
  names = [calibrate.name(r) for r in got["records"]]
  if rounds is None:
    assert names == ["none/even", "none/semi", "steady/even", "steady/semi"]
  else:
    assert names == [f"{s}/{p}@{r}" for s in ("none", "steady") for p in ("even", "semi")
                     for r in range(rounds)]
  for rec in got["records"]:
    k = rec["round"] or 0
    assert rec["step_times_s"][0] == pytest.approx((1.2 if rec["policy"] == "semi" and k == 1
                                                    else 1.0) * (0.1 + k))
    assert rec["migrations"] == k
    assert rec["contention"] == ([[0.5, 9.0 + k]] if rec["scenario"] == "steady" else None)
    # The round's own decision log: its one change.
    assert rec["decisions"] == ([{"step": 5, "owned": {"mlp": [5 + k, 3 - k]},
                                  "computed": {"mlp": [5, 3]}, "keep": None}]
                                if rec["policy"] == "semi" else [])
  runs = 1 if rounds is None else rounds
  assert got["warmup_move_s"] == [0.2] * 2 * runs
  assert got["contended_speeds"] == pytest.approx([0.9] * runs)   # past SETTLE_DECISIONS
  assert got["idle_min_speeds"] == pytest.approx([0.5, 0.7, 0.9] * runs)
  # Each run is compared with the even run of its own round.
  want = {("none", "semi", r): (0.2 if r == 1 else 0.0) for r in range(runs)}
  want.update({("steady", "semi", r): v for (_, _, r), v in want.items()})
  if rounds is None:
    want = {(s, p, None): v for (s, p, _), v in want.items()}
  assert calibrate.consistency(got) == pytest.approx(want)
  assert [calibrate.name(r) for r in calibrate.consistent(got)["records"]] == [
      n for n in names if not n.endswith("semi@1")]


def test_nnls_keeps_coefficients_non_negative_and_finds_the_optimum():
  # The optimum over every set of non-negative columns (exhaustive), at columns of very
  # different scales, as the fit's features are.
  rng = np.random.default_rng(0)
  for trial in range(20):
    a = rng.random((20, 4)) * np.array([1.0, 1e10, 1e-3, 1e5])
    b = a @ (rng.normal(size=4) / np.array([1.0, 1e10, 1e-3, 1e5])) + 0.1 * rng.normal(size=20)
    x = calibrate.nnls(a, b)
    assert (x >= 0).all()
    best = np.linalg.norm(b)
    for mask in range(1, 16):
      cols = [j for j in range(4) if mask >> j & 1]
      y = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
      if (y >= 0).all():
        best = min(best, np.linalg.norm(a[:, cols] @ y - b))
    assert np.linalg.norm(a @ x - b) <= best * (1 + 1e-9) + 1e-12, trial


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
  (on, off), *_ = rec["contention"]
  assert t.at(0, on + 0.01)[0].tolist() == [1.0, 0.4]
  assert t.at(0, off + 0.01)[0].tolist() == [1.0, 1.0]
  assert isinstance(t, traces.Trace) and isinstance(calibrate.run_of(real, rec, hardware.Hardware(
      "x", device_flops=1e10)), simulator.Run)
