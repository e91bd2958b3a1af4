"""The simulator's constants, fitted to this machine's measured runs, and replays that check them.

Measurements (`extract_*`; small JSON copies in benchmarks/measurements/), one record per run:
the benchmark runs every (scenario, policy) cell in interleaved rounds, and each round's run is
its own record (`name`: SCENARIO/POLICY@ROUND), compared with `even` and the oracle of its round:

  straggler_real      the straggler benchmark's real-contention part (2 processes x 1 CPU device,
                      tensor = 2, a CPU-bound competitor on core 1: none / steady / bursts), every
                      policy: step times, the competitor's on-intervals, the oracle's split, and
                      from the decision logs the speeds the controller measured, the seconds of
                      a speed sample and of the warm-up's timed migration;
  straggler_emulated  its emulated part (one process, 8 fake devices, the authors' static
                      profile and rotating straggler as a host sleep);
  migrate             `experiments/bench_migrate.py`: seconds and bytes of migrations.

Profiles fitted here (`hardware.Hardware`):

  cpu_2proc  the real-contention setting. Device speeds in the replay are the measured ones
             (the competitor's on-intervals at the scheduler share the controller measured
             under contention); fitted: the FLOP rate, the per-step overhead, the branched and
             offload steps' extra compute, the idle speedup (the 2 processes share one physical
             core: with the competitor off, the fast one of an uneven split computes faster
             while the slow one waits) and the contention wait (a contended process wakes up
             late from the step's collectives) (a linear non-negative least-squares fit of the
             runs' mean step times, alternated with replays, since the decisions depend on the
             times); measured: a speed sample's seconds and noise, a migration's seconds.
  cpu_8fake  the emulated setting: the emulated delay is the library's `Emulator` itself; fitted
             the same way: what the 8 fake devices' real compute on 2 cores adds; migration
             costs from bench_migrate (fixed + state bytes at memory bandwidth + the
             all_to_all's bytes).

Two replays of every measured run (`replay`):

  scripted   the run's own decisions (its decision log's setups, at their steps) instead of
             deciding: everything else as in a simulated run. What it checks is the costs (the
             step model, migrations, samples): the fit uses it.
  decided    the library's current decision code decides, as in every simulated run. It checks
             the decisions too, as long as the decision code is the one that made the
             measurements: after a change to the controller, its errors show what the new
             controller would have done differently (and the measurements should be renewed).

`check` reports, per run, the predicted and measured mean step time, tokens/s, and ratios to
`even` and to the oracle (`static`) of the same scenario.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os

import numpy as np
import scipy.optimize

from semijax.balance import decisions as decisions_lib
from semijax.balance import resize as resize_spec_lib
from semijax.balance import settings as settings_lib
from semijax.balance.cost import Setup
from semijax.core import emulation
from semijax.core import precision as precision_lib
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import simulator
from semijax.sim import stepcost
from semijax.sim import traces as traces_lib
from semijax.sim import workload as workload_lib

REAL, EMULATED = "cpu_2proc", "cpu_8fake"
# Decisions whose speeds still mix the time before the competitor started (the first window).
SETTLE_DECISIONS = 2


# --- measurements --------------------------------------------------------------------------------


def _runs(raw: dict):
  """(scenario, policy, round, run) for every run of a straggler benchmark's raw file. A cell is
  a list of runs, one per round (`round` in the run, in runs/SCENARIO/POLICY/roundR/); a cell of
  the format before rounds is a single run (round None, in runs/SCENARIO/POLICY/)."""
  for scenario, cells in raw["runs"].items():
    for policy, cell in cells.items():
      if isinstance(cell, dict):
        yield scenario, policy, None, cell
        continue
      for i, run in enumerate(cell):
        yield scenario, policy, run.get("round", i), run


def _run_dir(results_dir: str, scenario: str, policy: str, round_: int | None) -> str:
  path = os.path.join(results_dir, "runs", scenario, policy)
  return path if round_ is None else os.path.join(path, f"round{round_}")


def _config(run_dir: str) -> dict:
  with open(os.path.join(run_dir, "config.json")) as f:
    return json.load(f)


def _setting(config: dict) -> dict:
  """What a replay needs of a run's config."""
  keep = ("model", "batch_size", "mesh", "balance", "resize", "hetero", "optimizer")
  return {k: config[k] for k in keep if k in config}


def _record(scenario: str, policy: str, round_: int | None, run: dict, config: dict,
            decisions: list) -> dict:
  layout = config.get("layout", {})
  counts = {k: list(layout[k]) for k in ("mlp", "heads") if isinstance(layout.get(k), list)}
  c = run.get("contention") or {}
  return {"scenario": scenario, "policy": policy, "round": round_,
          "steps": len(run["step_times_s"]),
          "step_times_s": run["step_times_s"], "tokens_per_s": run["tokens_per_s"],
          "migrations": run["migrations"], "final_counts": run["final_counts"],
          "layout": counts or None, "contention": c.get("intervals"),
          "hetero": config.get("hetero"),
          "decisions": [{k: d[k] for k in ("step", "owned", "computed", "keep")}
                        for d in decisions if d["changed"]]}


def name(x: dict) -> str:
  """SCENARIO/POLICY@ROUND of a record or `check` row (no @ROUND before rounds)."""
  r = x.get("round")
  return f"{x['scenario']}/{x['policy']}" + ("" if r is None else f"@{r}")


def _key(x: dict) -> tuple:
  return x["scenario"], x["policy"], x.get("round")


def extract_real(results_dir: str) -> dict:
  """The measurements of a straggler benchmark's real part (`real_raw.json` and its runs): one
  record per run, every round's run its own."""
  with open(os.path.join(results_dir, "real_raw.json")) as f:
    raw = json.load(f)
  records, samples, moves, contended, idle = [], [], [], [], []
  for scenario, policy, round_, run in _runs(raw):
    run_dir = _run_dir(results_dir, scenario, policy, round_)
    ds = decisions_lib.read(run_dir)
    records.append(_record(scenario, policy, round_, run, _config(run_dir), ds))
    samples += [d["sample_s"] for d in ds]
    if ds and ds[0]["cost"]["move_s"] > 0:
      moves.append(ds[0]["cost"]["move_s"])            # the warm-up's timed migration
    if scenario == "steady":
      contended += [min(d["speeds"]) for d in ds[SETTLE_DECISIONS:]]
    if scenario == "none":
      idle += [min(d["speeds"]) for d in ds]
  return {"kind": "real", "source": os.path.relpath(results_dir),
          "setting": _setting(raw["config"]),
          "probe_speeds": raw["speeds"], "bursts": raw["bursts"],
          "contention_speed": float(np.median(contended)), "contended_speeds": contended,
          "idle_min_speeds": idle,
          "sample_s": samples, "warmup_move_s": moves, "records": records}


def extract_emulated(results_dir: str) -> dict:
  """The measurements of a straggler benchmark's emulated part (`emulated_raw.json`): one record
  per run, every round's run its own."""
  with open(os.path.join(results_dir, "emulated_raw.json")) as f:
    raw = json.load(f)
  records, samples, setting = [], [], None
  for scenario, policy, round_, run in _runs(raw):
    run_dir = _run_dir(results_dir, scenario, policy, round_)
    config = _config(run_dir)
    setting = setting or _setting(config)
    ds = decisions_lib.read(run_dir)
    records.append(_record(scenario, policy, round_, run, config, ds))
    samples += [d["sample_s"] for d in ds]
  return {"kind": "emulated", "source": os.path.relpath(results_dir), "setting": setting,
          "sample_s": samples, "records": records}


def extract_migrate(path: str) -> dict:
  """The rows of `experiments/bench_migrate.py`'s results.json that the fit uses."""
  with open(path) as f:
    raw = json.load(f)
  rows = [{"model": r["model"], "share": r["share"], "moved_bytes": r["moved_bytes"],
           "wire_bytes": r["wire_bytes"], "migrate_s": r["migrate_s"]} for r in raw["rows"]]
  models = {n: {"step_s": m["step_s"], "state_bytes": m["state_bytes"],
                "chunk_capacity": m["chunk_capacity"]} for n, m in raw["models"].items()}
  return {"kind": "migrate", "source": os.path.relpath(path), "devices": raw["devices"],
          "quick": raw["quick"], "rows": rows, "models": models}


def load_measurements(directory: str) -> dict:
  """{"real", "emulated", "migrate"} from the JSON files in `directory`."""
  out = {}
  for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
    with open(path) as f:
      d = json.load(f)
    if isinstance(d, dict) and d.get("kind") in ("real", "emulated", "migrate"):
      out[d["kind"]] = d
  return out


# --- replays -------------------------------------------------------------------------------------


def workload_of(setting: dict) -> workload_lib.Workload:
  """The replayed run's model, batch and precision (float32 where the record predates them)."""
  m = setting["model"]
  precision = precision_lib.Precision(**{f.name: m[f.name] for f in dataclasses.fields(
      precision_lib.Precision) if f.name in m})
  return workload_lib.Workload.gpt(
      d_model=m["d_model"], num_heads=m["num_heads"], d_ff=m["d_ff"], num_layers=m["num_layers"],
      seq_len=m["seq_len"], vocab_size=m["vocab_size"],
      batch_per_replica=setting["batch_size"] // setting["mesh"]["data"], precision=precision,
      mu_dtype=setting.get("optimizer", {}).get("mu_dtype", ""))


def _resize_spec(d: dict) -> resize_spec_lib.ResizeSpec:
  d = dict(d)
  for k in ("keep", "fractions"):
    d[k] = tuple(d.get(k, ()))
  if isinstance(d.get("straggler"), list):
    d["straggler"] = tuple(d["straggler"])
  return resize_spec_lib.ResizeSpec(**d)


def script_of(record: dict) -> dict:
  """{0-based step: `cost.Setup`}: the setups `record`'s decision log changed to."""
  tup = lambda d: {k: tuple(int(x) for x in v) for k, v in d.items()}
  return {d["step"]: Setup(tup(d["owned"]), tup(d["computed"]),
                           None if d["keep"] is None else tuple(float(k) for k in d["keep"]))
          for d in record.get("decisions", ())}


def run_of(measured: dict, record: dict, hw: hardware_lib.Hardware, seed: int = 0,
           scripted: bool = False) -> simulator.Run:
  """The simulated run that replays `record` (one measured run) on hardware `hw`, with its own
  decisions (`scripted`) or the library's."""
  s = measured["setting"]
  # A record without `drain` was measured before a policy could drain a device: replay it so.
  balance = {"drain": False, **s["balance"], "policy": record["policy"]}
  hetero = None
  if record.get("hetero") and record["hetero"].get("slowdown"):
    h = record["hetero"]
    # A record without `repeated` was emulated before the repeated work was charged.
    hetero = emulation.Hetero(tuple(h["slowdown"]), h["device_gflops"], h["rotate_every"],
                              h.get("repeated", False))
  counts = (record["layout"],) if record["policy"] == "static" and record["layout"] else None
  return simulator.Run(
      workload_of(s), cluster_lib.Cluster(s["mesh"]["data"], 1, s["mesh"]["tensor"]), hw,
      settings_lib.BalanceSettings(**balance), record["steps"], resize=_resize_spec(s["resize"]),
      static_counts=counts, hetero=hetero, seed=seed,
      script=(script_of(record),) if scripted else None, idle_feature=True)


def trace_of(measured: dict, record: dict, contention_speed: float | None = None
             ) -> traces_lib.Trace:
  """The measured speeds of `record`: the competitor's intervals on the last tensor device (the
  process on the shared core) at `contention_speed` (default: the median the controllers
  measured), or none (emulated: the `Hetero` drives the replay)."""
  n = measured["setting"]["mesh"]["tensor"] * measured["setting"]["mesh"]["data"]
  speed = measured.get("contention_speed") if contention_speed is None else contention_speed
  rows = []
  for on, off in record.get("contention") or ():
    rows += [[on, n - 1, speed], [off, n - 1, 1.0]]
  return traces_lib.Trace(n, 1, rows)


def replay(measured: dict, record: dict, hw: hardware_lib.Hardware, seed: int = 0,
           contention_speed: float | None = None, scripted: bool = False) -> simulator.Result:
  """`record` simulated with its own decisions (`scripted`) or the library's (module doc)."""
  return simulator.simulate(run_of(measured, record, hw, seed, scripted),
                            trace_of(measured, record, contention_speed))


# --- the fit -------------------------------------------------------------------------------------


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
  """Least squares min |a x - b| with x >= 0, exactly (Lawson-Hanson, `scipy.optimize.nnls`,
  on columns scaled to unit norm: the features differ by 10 orders of magnitude). (Dropping
  the most negative coefficient of the unconstrained solution and solving again can drop a
  column the optimum keeps.)"""
  norm = np.linalg.norm(a, axis=0)
  norm = np.where(norm > 0, norm, 1.0)
  return scipy.optimize.nnls(a / norm, b)[0] / norm


# The column of `simulator.coefficients` of the idle speedup (the contention wait's is next).
IDLE = 2 + len(stepcost.OVERHEADS)


def _with_coefficients(hw: hardware_lib.Hardware, x: np.ndarray,
                       idle: bool = True) -> hardware_lib.Hardware:
  """`hw` with `simulator.coefficients` = x (see `fit_steps`); with `idle` the idle speedup
  1 / (1 - g), g = x[IDLE] / x[1], within [1, `hardware.MAX_IDLE_SPEEDUP`] (else `hw`'s)."""
  if x[1] <= 0:
    raise ValueError("calibration: the fit found no compute term; the measurements cannot "
                     "determine the FLOP rate")
  overheads = {name: float(v / x[1]) for name, v in zip(stepcost.OVERHEADS.values(), x[2:IDLE])}
  g = min(float(x[IDLE] / x[1]), 1 - 1 / hardware_lib.MAX_IDLE_SPEEDUP)
  return dataclasses.replace(hw, step_overhead_s=float(x[0]), device_flops=float(1 / x[1]),
                             idle_speedup=1 / (1 - g) if idle else hw.idle_speedup,
                             contention_wait_s=float(x[IDLE + 1]), **overheads)


# A measured run whose steps before its first change (the even split's program, exactly what the
# scenario's `even` run runs) differ from `even`'s same steps by more than this is noisier than
# the tolerance of a replay; the fit leaves it out and the check reports it (`consistency`).
CONSISTENCY = 0.10
# ... judged on at least this many steps before the first change.
MIN_IDENTICAL_STEPS = 5


def consistency(measured: dict) -> dict:
  """{(scenario, policy, round): mean of the run's steps before its first change / mean of the
  same steps of the `even` run of its scenario and round - 1}, for runs of the controlled
  policies with at least `MIN_IDENTICAL_STEPS` such steps (they run the even split's
  single-width step, as `even` does; `offload` runs its own step and is left out)."""
  even = {(r["scenario"], r.get("round")): np.asarray(r["step_times_s"])
          for r in measured["records"] if r["policy"] == "even"}
  out = {}
  for r in measured["records"]:
    ref = even.get((r["scenario"], r.get("round")))
    if r["policy"] in ("even", "static", "offload") or ref is None:
      continue
    first = min([d["step"] for d in r.get("decisions", ())] + [len(r["step_times_s"])])
    n = min(first, len(ref))
    if n >= MIN_IDENTICAL_STEPS:
      out[_key(r)] = float(np.mean(r["step_times_s"][:n]) / ref[:n].mean() - 1)
  return out


def consistent(measured: dict) -> dict:
  """`measured` without the runs `consistency` finds off their identical twin by more than
  `CONSISTENCY`."""
  off = {k for k, v in consistency(measured).items() if abs(v) > CONSISTENCY}
  return dict(measured, records=[r for r in measured["records"] if _key(r) not in off])


def fit_steps(measured: dict, hw: hardware_lib.Hardware, iterations: int = 20, seed: int = 0,
              contention_speed: float | None = None, idle: bool = True) -> hardware_lib.Hardware:
  """`hw` with its step constants fitted to the measured runs' mean step times.

  The replays are scripted (each run's own decisions, module doc); pass `consistent(measured)`
  to leave out runs noisier than a replay's tolerance. Each replayed step is
  `features @ simulator.coefficients(hw)` (overhead, 1 / flops, each step variant's
  overhead / flops, with `idle` what full-speed devices that share cores gain while others
  wait, (1 - 1 / idle_speedup) / flops (without, `hw.idle_speedup` stays), and the contention
  wait's seconds) plus parts that do not depend on them (migrations, samples,
  collectives, the optimizer, an emulated sleep). A non-negative least-squares fit of the runs'
  means (relative errors: every run weighs the same) gives new constants; the runs are replayed
  with them (the decisions, and a contention interval's steps, depend on the times) and fitted
  again, up to `iterations` times or until the constants stop changing (from a cold start the
  contention wait, the overhead and the FLOP rate trade places for several rounds); the
  constants whose replays matched best are returned.
  """
  best = None
  for _ in range(iterations):
    rows, targets = [], []
    for rec in measured["records"]:
      r = replay(measured, rec, hw, seed, contention_speed, scripted=True)
      mean_s = np.mean(rec["step_times_s"])        # relative errors: divide by the measured mean
      rows.append(r.features.mean(axis=0) / mean_s)
      targets.append((mean_s - r.fixed_s.mean()) / mean_s)
    rows, targets = np.asarray(rows), np.asarray(targets)
    if not idle:
      rows[:, IDLE] = 0.0                        # no column: the least-squares solution keeps 0
    error = float(np.mean(np.square(rows @ simulator.coefficients(hw) - targets)))
    if best is None or error < best[0]:
      best = (error, hw)
    new = _with_coefficients(hw, _solve(rows, targets), idle)
    done = np.allclose(simulator.coefficients(new), simulator.coefficients(hw), rtol=1e-9, atol=0)
    hw = new
    if done:                                     # a fixed point: the replays would not change
      break
  return best[1] if best[0] <= _replay_error(measured, hw, seed, contention_speed) else hw


def _solve(rows: np.ndarray, targets: np.ndarray) -> np.ndarray:
  """`nnls(rows, targets)`; when every run executes about the same FLOPs (the emulated runs:
  their time is the emulated sleep, the same model on every device), the fixed overhead
  absorbs the compute and leaves it no term. The fixed overhead is then dropped: what every
  run's step spends beyond the modelled parts is charged to its FLOPs."""
  x = nnls(rows, targets)
  if x[1] <= 0:
    x = np.concatenate([[0.0], nnls(rows[:, 1:], targets)])
  return x


def _replay_error(measured: dict, hw: hardware_lib.Hardware, seed: int, contention_speed) -> float:
  """Mean squared relative error of the replays' mean step times."""
  err = [np.mean(replay(measured, rec, hw, seed, contention_speed, scripted=True).step_s)
         / np.mean(rec["step_times_s"]) - 1 for rec in measured["records"]]
  return float(np.mean(np.square(err)))


def fit_moves(migrate: dict) -> dict:
  """{move_fixed_s, move_local_bytes_per_s, move_bytes_per_s} from bench_migrate: seconds of a
  migration = fixed + the device's state bytes (local gathers) / their rate + the device's
  all_to_all bytes / the collective's bandwidth."""
  n = migrate["devices"]
  a, b = [], []
  for r in migrate["rows"]:
    m = migrate["models"][r["model"]]
    a.append([1.0, m["state_bytes"] / n, r["wire_bytes"] / n])
    b.append(r["migrate_s"])
  for m in migrate["models"].values():
    c = m["chunk_capacity"]
    a.append([1.0, m["state_bytes"] / n, c["wire_bytes"] / n])
    b.append(c["seconds"])
  x = nnls(np.asarray(a), np.asarray(b))
  inv = lambda v: float(1 / v) if v > 0 else float("inf")
  return {"move_fixed_s": float(x[0]), "move_local_bytes_per_s": inv(x[1]),
          "move_bytes_per_s": inv(x[2])}


def sample_noise(idle_min_speeds) -> float:
  """The std of log(measured / true time) of one sample, from the slower of two equal devices'
  relative speeds when nobody is slow (log of it: minus |difference of two samples|, whose
  mean square is twice the variance)."""
  x = np.log(np.asarray(idle_min_speeds, np.float64))
  return float(np.sqrt(np.mean(x * x) / 2)) if len(x) else 0.0


def step_noise(records) -> float:
  """Step-to-step jitter of the runs that neither sample nor change (`even`, `static`): the
  median over runs of a robust std of log step time (from consecutive differences)."""
  out = []
  for rec in records:
    if rec["policy"] in ("even", "static"):
      d = np.diff(np.log(np.asarray(rec["step_times_s"][1:], np.float64)))
      out.append(np.median(np.abs(d)) / 0.6745 / np.sqrt(2))
  return float(np.median(out)) if out else 0.0


def net_sample_s(measured: dict) -> float:
  """What a speed sample adds to a step, net: in scenario `none` the policies that sample
  (every `probe_every` steps) and `even` / `static` (never) train the same even split; the
  difference of their mean step times, per sample, at least 0. (A sample's shared gather waits
  for the slowest process, a wait the next step's collective would otherwise have had; its
  logged duration, `sample_s` in the decision logs, is not what it costs.)"""
  none = [r for r in measured["records"] if r["scenario"] == "none"]
  plain = [np.mean(r["step_times_s"]) for r in none if r["policy"] in ("even", "static")]
  sampled = [np.mean(r["step_times_s"]) for r in none if r["policy"] not in ("even", "static")]
  if not plain or not sampled:
    return float(np.mean(measured["sample_s"]))
  every = measured["setting"]["balance"]["probe_every"]
  return max(0.0, float(np.mean(sampled) - np.mean(plain)) * every)


def _loss(rows: list[dict]) -> float:
  """Mean squared log error of the step times and of the ratios to `even`."""
  err = [np.log1p(x["step_error"]) for x in rows]
  err += [np.log1p(x["vs_even_error"]) for x in rows if x["policy"] != "even"]
  return float(np.mean(np.square(err)))


def fit(measurements: dict, iterations: int = 20, grid_step: float = 0.005,
        seeds=(0, 1, 2), contention_speeds=None) -> tuple[dict, dict]:
  """({profile name: Hardware}, {profile name: replay parameters}) fitted to `measurements`.

  The real setting has one more unknown: the speed at which the process that shares its core
  computes. The controllers measured its scheduler share (`contention_speed`, a median, and its
  10th to 90th percentile); the fit takes the speed in that range whose replays match the
  measured step times and ratios best (`_loss`, over `seeds` of the simulated noise), on a grid
  of `grid_step` (or among `contention_speeds`), fitting the step constants at each.
  """
  moves = fit_moves(measurements["migrate"])
  emu = measurements["emulated"]
  emulated = hardware_lib.Hardware(
      EMULATED, device_flops=1e10, cores=2, emulated=True, step_noise=step_noise(emu["records"]),
      sample_s=float(np.mean(emu["sample_s"])),
      source="fitted by semijax.sim.calibrate to straggler_emulated and migrate", **moves)
  emulated = fit_steps(consistent(emu), emulated, iterations, idle=False)
  real = measurements["real"]
  cpu = hardware_lib.Hardware(
      REAL, device_flops=1e10, move_fixed_s=float(np.median(real["warmup_move_s"])),
      sample_s=net_sample_s(real), sample_noise=sample_noise(real["idle_min_speeds"]),
      step_noise=step_noise(real["records"]),
      source="fitted by semijax.sim.calibrate to straggler_real")
  lo, hi = np.percentile(real["contended_speeds"], [10, 90])
  best = None
  grid = np.arange(lo, hi + 1e-9, grid_step) if contention_speeds is None else contention_speeds
  for speed in grid:
    hw = fit_steps(consistent(real), cpu, iterations, contention_speed=float(speed))
    loss = _loss([x for x in check(real, hw, seeds=seeds, contention_speed=float(speed),
                                   scripted=True) if not x["noisy"]])
    if best is None or loss < best[0]:
      best = (loss, float(speed), hw)
  _, speed, cpu = best
  return ({EMULATED: emulated, REAL: cpu},
          {EMULATED: {}, REAL: {"contention_speed": speed,
                                "contention_speed_range": [float(lo), float(hi)]}})


# --- the check -----------------------------------------------------------------------------------


def check(measured: dict, hw: hardware_lib.Hardware, *, seeds=(0, 1, 2),
          contention_speed: float | None = None, scripted: bool = False) -> list[dict]:
  """One row per measured run: predicted (the mean over `seeds` of the simulated noise) vs
  measured mean step time, tokens/s and ratios to `even` and to the oracle (`static`) of its
  scenario and round (repeats of one measurement by their median, `REPEATS`); `*_error` =
  predicted / measured - 1; `twin_error` and `noisy`: `consistency`."""
  rows = []
  for rec in measured["records"]:
    runs = [replay(measured, rec, hw, seed, contention_speed, scripted) for seed in seeds]
    rows.append({"scenario": rec["scenario"], "policy": rec["policy"], "round": rec.get("round"),
                 "measured_s": float(np.mean(rec["step_times_s"])),
                 "predicted_s": float(np.mean([r.step_s.mean() for r in runs])),
                 "measured_tps": rec["tokens_per_s"],
                 "predicted_tps": float(np.mean([r.tokens_per_s for r in runs])),
                 "measured_migrations": rec["migrations"],
                 "predicted_migrations": float(np.mean([r.stat("migrations") for r in runs]))})
  _pool_repeats(rows)
  twins = consistency(measured)
  for x in rows:
    x["twin_error"] = twins.get(_key(x))
    x["noisy"] = x["twin_error"] is not None and abs(x["twin_error"]) > CONSISTENCY
  by = {_key(x): x for x in rows}
  for x in rows:
    x["step_error"] = x["predicted_s"] / x["measured_s"] - 1
    for ref, ratio in (("even", "vs_even"), ("static", "vs_oracle")):
      other = by.get((x["scenario"], ref, x["round"]))
      if other is None:
        continue
      meas = x["measured_tps"] / other["measured_tps"]
      pred = x["predicted_tps"] / other["predicted_tps"]
      x[f"measured_{ratio}"], x[f"predicted_{ratio}"] = meas, pred
      x[f"{ratio}_error"] = pred / meas - 1
  return rows


# Runs of the straggler benchmark that train the same split the same way: in `none` nobody is
# slow, so these policies all run the even split's single-width step and never change it (the
# benchmark's `SAME_SPLIT_POLICIES`, which it reads as the noise of one run). They are repeats of
# one measurement; a replay is compared with their median (over every round).
REPEATS = {"none": ("even", "static", "resize", "migrate", "semi")}


def _pool_repeats(rows: list[dict]) -> None:
  """Sets the measured step time and tokens/s of every run in a `REPEATS` group to the group's
  median (the single values stay in `measured_single_*`)."""
  for scenario, policies in REPEATS.items():
    group = [x for x in rows if x["scenario"] == scenario and x["policy"] in policies]
    if len(group) < 2:
      continue
    step = float(np.median([x["measured_s"] for x in group]))
    tps = float(np.median([x["measured_tps"] for x in group]))
    for x in group:
      x["measured_single_s"], x["measured_single_tps"] = x["measured_s"], x["measured_tps"]
      x["measured_s"], x["measured_tps"] = step, tps


def worst(rows: list[dict]) -> dict:
  """The largest absolute errors of the `check` rows that are not `noisy`: step time, ratio to
  even, ratio to the oracle; and the noisy runs."""
  out = {"noisy": [name(x) for x in rows if x.get("noisy")]}
  for key in ("step_error", "vs_even_error", "vs_oracle_error"):
    vals = [abs(x[key]) for x in rows if key in x and not x.get("noisy")]
    out[key] = max(vals) if vals else 0.0
  return out


def markdown(rows: list[dict], title: str) -> str:
  """The `check` rows as a markdown table."""
  pct = lambda v: "–" if v is None else f"{v:+.1%}"
  num = lambda v: "–" if v is None else f"{v:.2f}"
  lines = [f"#### {title}", "", "| scenario | policy@round | measured s/step | predicted | error "
           "| vs even: measured | predicted | error | vs oracle: measured | predicted | error "
           "| migrations: measured | predicted | identical steps vs even's |", "|---" * 14 + "|"]
  for x in rows:
    run = name(x).split("/", 1)[1]      # policy@round
    lines.append(
        f"| {x['scenario']} | {run} | {x['measured_s']:.4f} | {x['predicted_s']:.4f} "
        f"| {pct(x['step_error'])} | {num(x.get('measured_vs_even'))} "
        f"| {num(x.get('predicted_vs_even'))} | {pct(x.get('vs_even_error'))} "
        f"| {num(x.get('measured_vs_oracle'))} | {num(x.get('predicted_vs_oracle'))} "
        f"| {pct(x.get('vs_oracle_error'))} | {x['measured_migrations']} "
        f"| {x['predicted_migrations']:.1f} "
        f"| {pct(x.get('twin_error'))}{' (noisy)' if x.get('noisy') else ''} |")
  return "\n".join(lines) + "\n"
