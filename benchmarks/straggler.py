"""The straggler benchmark: every balancing policy under real and emulated slow devices.

Real contention (`run_real_worker`, one of 2 processes started by `launch`): two processes, one
CPU device each (`tensor` = 2), pinned to their own cores, train gpt_tiny; a competing CPU-bound
process (`contention.Injector`) shares the core of process 1: never (`none`), the whole time
(`steady`) or on/off (`bursts`). Process 0 starts the competitor right after each run's warm-up
and stops it after the run. Before the runs, `calibrate` measures the devices' speeds while they
train (with and without the competitor) and the work every device repeats at its own speed
(`repeat`: of the time-balanced splits for a few values, the one that ran fastest under steady
contention). The `static` oracle of a scenario is the time-balanced split at its speeds with
that work (`split_counts`; for bursts, at the time-weighted mean of the two speeds), and the
controlled policies hold the same `repeat` in their cost model (`balance.fit_repeat` off: the
calibration timed it; fitted online across speed regimes, it wandered from 0.0 to 1.0 and cost
extra moves).

Emulated slowdowns (`run_emulated`, one process, 8 fake devices): the authors' static profile
(8, 6, 4, 2, 1, 1, 1, 1) and their rotating straggler (8 on one device, moving every few steps).

This machine drifts (other jobs, heat, the page cache), so every cell runs in `rounds`
interleaved rounds (`rounds.round_orders`): a round runs every policy of a scenario once, and the
order of the policies rotates from round to round, so that drift hits every policy alike.
Round r trains from seed `base seed + r`, for every policy: within a round every run starts from
the same model and data order (the paired baseline), and the rounds are the seeds of the
accuracy figures. Each run evaluates `EVALS_PER_RUN` times, off the clock, for the time to reach
`even`'s final validation loss.

`summarize` turns the raw runs into the results (`summarize_cell`): medians of tokens/s with
their min-max spread, ratios to `even` and to the oracle (`static`) of the same scenario (of
medians, and the median of the per-round paired ratios), final validation loss (median and
mean) against `even`'s, the time to reach `even`'s final validation loss, compilations after
warm-up and the controller's decisions; and every run's own figures (`runs`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time

import jax
import numpy as np

from benchmarks import report
from benchmarks import rounds as rounds_lib
from semijax.balance import probe as probe_lib
from semijax.balance import speed
from semijax.core import layout as layout_lib
from semijax.runtime import contention
from semijax.runtime import distributed
from semijax.runtime import hostcpu
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics as metrics_lib
from semijax.train import tensor as tensor_lib

SCENARIOS = ("none", "steady", "bursts")
EMULATED = ("static_profile", "rotating")
POLICIES = ("even", "static", "resize", "migrate", "offload", "semi")
# A controlled policy with another speed source: "semi@probe" is semi measuring with the probe
# (`balance.measure`), beside "semi" with the default source; for comparing the sources.
MEASURED = tuple(f"{p}@{m}" for p in ("resize", "migrate", "offload", "semi")
                 for m in ("sched", "probe"))
PROFILE = (8.0, 6.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0)
ROTATING = (8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
SAME_SPEED = 0.9     # oracle speeds all at least this (relative): the cores are equal
ROUNDS = 3           # runs of every cell, in interleaved rounds
EMULATED_STEPS = {False: 24, True: 8}   # steps of an emulated run (full, --quick)
EVALS_PER_RUN = 8    # validation points of every run (the time to reach a loss); 4 with --quick
CALIBRATION_REPEATS = (0.0, 0.2, 0.4, 0.6)   # repeated work tried by the calibration
CALIBRATION_STEPS = 30                       # steps of each calibration run (20 with --quick)
CALIBRATION_PASSES = 2                       # passes over them, order reversed every other (1)
# A run has reached a validation loss within this relative tolerance: runs of exactly the same
# model on different layouts differ by float rounding (about 1e-6), not by more.
LOSS_TOL = 1e-4


def _bench_config(arg: str, steps: int, log_every: int, num_widths: int, quick: bool):
  """gpt_tiny (config argument `arg`) for benchmark runs: `EVALS_PER_RUN` evaluations (half
  with `quick`), no checkpoints but the last, `num_widths` compute widths in the dynamic
  policies' bucket."""
  c = config_lib.load(os.path.join(_root(), "configs", "gpt_tiny.py") + ":" + arg)
  c.steps = steps
  c.eval_every = max(1, steps // (EVALS_PER_RUN // 2 if quick else EVALS_PER_RUN))
  c.log_every = log_every
  c.checkpoint_every = 0
  c.keep_checkpoints = 1
  c.balance.num_widths = num_widths
  return c


def real_steps(quick: bool, scenario: str) -> int:
  """Steps of a real-contention run: 32 with --quick; else 300, and 60 without contention
  (where only the cost of measuring is at stake), which keeps the full benchmark within an
  hour."""
  return 32 if quick else (60 if scenario == "none" else 300)


def real_schedule_steps(quick: bool) -> int:
  """Steps of the learning-rate schedule of every real-contention run (the calibration's and
  the shorter runs without contention included): the schedule is a constant of the compiled
  step, so one schedule is what lets every run of a policy reuse its first run's programs
  (`train.loop`'s engine cache keys on the schedule's length, not on the run's steps)."""
  return max(real_steps(quick, s) for s in SCENARIOS)


def real_config(quick: bool, scenario: str = "steady"):
  """gpt_tiny on 2 tensor devices (one per process), sized so compute dominates communication."""
  c = _bench_config("cpu,tensor=2", real_steps(quick, scenario), log_every=20, num_widths=7,
                    quick=quick)
  c.model.d_model, c.model.d_ff, c.model.num_layers = 256, 1024, 2
  c.batch_size = 16       # smaller batches leave the split less to win (collective latency)
  c.optimizer.schedule_steps = real_schedule_steps(quick)
  c.balance.probe_every = 2   # react within a few steps: the quick bursts last 4 s
  # Up to 896 of 1024 units, in 7 widths of 128: room for the time-balanced split under steady
  # contention (about 900 / 120 at speed 0.38; a proportional split would be 740 / 280).
  c.balance.capacity_factor = 1.75
  return c


def emulated_config(quick: bool, scenario: str):
  """gpt_tiny on 8 fake devices with an emulated slowdown profile. The dynamic policies' big
  bucket compiles 16 widths (every 8 of its 128 MLP units): with 8, a split on widths 16 apart
  left the slowest device a quarter more work than the oracle's split in granules of 8."""
  c = _bench_config("cpu", EMULATED_STEPS[quick], log_every=8, num_widths=16, quick=quick)
  c.model.num_layers = 1
  c.hetero.slowdown = PROFILE if scenario == "static_profile" else ROTATING
  # The rotating straggler's run has 4 periods of one straggler (2 with --quick).
  periods = 2 if quick else 4
  c.hetero.rotate_every = 0 if scenario == "static_profile" else EMULATED_STEPS[quick] // periods
  return c


def policy_config(base, policy: str, oracle_speeds, seed: int | None = None,
                  repeat: float = 0.0, fit_repeat: bool = True):
  """`base` for one policy (and `seed`, if given), with `repeat` as the cost model's prior of
  the work every device repeats at its own speed; `static` gets the time-balanced split at
  `oracle_speeds` with that work (`split_counts`: the oracle; even when every speed is within
  `SAME_SPEED` of the fastest, as for two idle cores measured with noise), which compiles
  exactly its own widths. `fit_repeat` False: the controlled policies hold `repeat`.
  "policy@measure" (`MEASURED`) also sets `balance.measure`."""
  c = copy.deepcopy(base)
  policy, _, measure = policy.partition("@")
  if measure:
    c.balance.measure = measure
  c.balance.policy = policy
  c.balance.repeat_share = repeat
  c.balance.fit_repeat = fit_repeat
  if seed is not None:
    c.seed = seed
  if oracle_speeds is not None and min(oracle_speeds) >= SAME_SPEED:
    oracle_speeds = [1.0] * len(oracle_speeds)     # equal cores measured with noise: even split
  if policy == "static":
    for kind, units in (("mlp", c.model.d_ff), ("heads", c.model.num_heads)):
      c.layout[kind] = split_counts(units, oracle_speeds, repeat)
  return c


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def val_curve(step_times_s, val_losses: dict) -> list[list[float]]:
  """[[training seconds, step, validation loss], ...] at every evaluated step.

  Args:
    step_times_s: seconds of steps 1, 2, ... (every balancing cost included, evaluation not).
    val_losses: {step: validation loss after that step}.
  """
  clock = np.concatenate([[0.0], np.cumsum(np.asarray(step_times_s, np.float64))])
  return [[float(clock[min(s, len(clock) - 1)]), int(s), float(v)]
          for s, v in sorted(val_losses.items())]


def _run_record(summary: dict, workdir: str, extra: dict) -> dict:
  """What the results keep of one run."""
  decisions = []
  path = os.path.join(workdir, "decisions.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      decisions = [json.loads(line) for line in f]
  changed = [{k: d[k] for k in ("step", "choice", "reason", "owned", "keep")}
             for d in decisions if d["changed"]]
  metrics = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  losses = {int(m["step"]): m["val/loss"] for m in metrics if "val/loss" in m}
  b = summary["balance"]
  dt = np.asarray(summary["step_times_s"])
  tokens_per_step = summary["tokens_per_s"] * summary["mean_step_time_s"]
  return {"tokens_per_s": float(len(dt) * tokens_per_step / dt.sum()),   # all steps, all costs
          "final_val_loss": summary["val/loss"],
          "compiles_after_warmup": b["compiles_after_warmup"], "migrations": b["migrations"],
          "decisions": b.get("decisions", 0), "changes": changed[:40],
          "measure_overhead": b.get("measure_overhead"),
          "step_times_s": [round(t, 5) for t in dt.tolist()],
          "val_curve": val_curve(dt, losses), "final_counts": b["layout_counts"], **extra}


def _print_run(scenario: str, policy: str, r: int, record: dict) -> None:
  print(f"[bench] round {r} {scenario:14s} {policy:8s} {record['tokens_per_s']:9.1f} tok/s  "
        f"val {record['final_val_loss']:.4f}{_steal_note(record.get('host_steal'))}", flush=True)


# --- real contention (runs inside each launched process) -----------------------------------------


def measure_speeds(probe, core: int, pattern: str, seconds: float) -> tuple[np.ndarray, list]:
  """(relative time of fixed work per device, device ids), measured over `seconds` of busy
  probing with the competitor `pattern` on `core` (started by process 0). With scheduler stats
  (Linux) the time is 1 / the CPU share each process got while busy; else the mean probe time."""
  injector = contention.Injector(core, pattern) if jax.process_index() == 0 else None
  if injector is not None:
    injector.start()
  sched = speed.SchedShare() if speed.SchedShare.available() else None
  try:
    samples = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
      samples.append(probe.measure())
    local = sched.measure() if sched is not None else {
        i: float(np.mean([s[i] for s in samples])) for i in samples[0]}
    every, _ = speed.gather_times(local)
  finally:
    if injector is not None:
      injector.stop()
  ids = sorted(every)
  return np.array([every[i] for i in ids]), ids


def _contended_run(config, workdir: str, cache: dict, core: int, scenario: str, on_s: float,
                   off_s: float, on_start=None):
  """Trains `config` in `workdir` with the competitor of `scenario` on `core` from the end of
  warm-up to the end of the run (started by process 0; `on_start`, if given, is called there
  too); returns (summary, injector or None, the host's steal share during the run or None:
  `hostcpu`)."""
  injector = None
  if jax.process_index() == 0 and scenario != "none":
    injector = contention.Injector(core, "steady" if scenario == "steady" else "bursts",
                                   on_s=on_s, off_s=off_s)

  def start():
    if injector is not None:
      injector.start()
    if on_start is not None:
      on_start()

  meter = hostcpu.StealMeter()
  try:
    summary = train.train_and_evaluate(config, workdir, engine_cache=cache, after_warmup=start)
  finally:
    if injector is not None:
      injector.stop()
  return summary, injector, meter.share()


def split_counts(units: int, speeds, repeat: float) -> tuple[int, ...]:
  """The time-balanced split of `units` at `speeds` with `repeat` (shares of the block work
  every device repeats at its own speed; `layout.bucketed_counts`), in granules of 1/64 of the
  units (odd GEMM widths run slower on CPU)."""
  g = max(1, units // 64) if units % max(1, units // 64) == 0 else 1
  return tuple(g * n for n in layout_lib.bucketed_counts(
      units // g, speeds, range(1, units // g + 1), offset=repeat * units / g))


def _timed_split(out: str, base, counts: dict, name: str, cache: dict, core: int,
                 pattern: str, sched, steps: int) -> tuple[float, np.ndarray | None, float | None]:
  """(median step seconds, the most of any process; relative device times while it trained, or
  None without scheduler stats; the host's steal share, or None) of a short `static` run of
  `counts` {kind: (fast, slow)} with the competitor `pattern`, identical on every process."""
  c = copy.deepcopy(base)
  c.steps, c.eval_every, c.balance.policy = steps, steps, "static"
  for kind, split in counts.items():
    c.layout[kind] = tuple(split)
  workdir = os.path.join(out, "runs", "calibration", name)
  if jax.process_index() == 0 and os.path.exists(workdir):
    shutil.rmtree(workdir)
  summary, _, steal = _contended_run(c, workdir, cache, core, pattern, 1.0, 1.0,
                                     on_start=None if sched is None else sched.warm_up)
  # Every process times its own steps: share the slowest process's median (and the scheduler's
  # shares), so that every process picks the same split from identical numbers.
  seconds = float(np.median(summary["step_times_s"][steps // 5:]))
  every, seconds = speed.gather_times({} if sched is None else sched.measure(), extra=seconds)
  relative = None if sched is None else np.array([every[i] for i in sorted(every)])
  return seconds, relative, steal


def _probe_times(base, core: int) -> dict:
  """{"none" | "steady": relative device times [N]} of the busy probe (`measure_speeds`), the
  speeds' fallback where the scheduler keeps no stats."""
  run = config_lib.validate(base)
  block = probe_lib.ProbeShape.of_block(run.model, tensor_lib.step_tokens(run), run.mesh.tensor)
  probe = probe_lib.Probe(probe_lib.ProbeShape.configured(base.balance.probe_size, block),
                          max(1, base.balance.probe_repeats))
  probe.warm_up()
  return {pattern: measure_speeds(probe, core, pattern, seconds)[0]
          for pattern, seconds in (("none", 2.0), ("steady", 3.0))}


def calibrate(out: str, base, cache: dict, core: int, quick: bool = False) -> dict:
  """Measures this machine before the rounds: the devices' speeds while they train, and how
  much work every device repeats at its own speed (`repeat`, in shares of the block work).

  First the even split, without and with the steady competitor, for the speeds (the
  scheduler's share while training, as the controlled policies measure it in a run; without
  scheduler stats, the busy probe's: `_probe_times`). Then, under steady contention, the
  time-balanced split (`split_counts`) for every `repeat` of `CALIBRATION_REPEATS`, in
  `CALIBRATION_PASSES` passes (order reversed every other pass) of `CALIBRATION_STEPS` steps
  (`quick`: one pass of 20): the `repeat` whose split ran fastest (median over the passes) is
  the machine's. On CPU most repeated work is dispatch and small ops, so FLOPs do not tell it;
  a split that is too skewed or not skewed enough both run slower, so the fastest one does.
  The oracle runs that split, the controlled policies start from that `repeat`.

  Returns:
    {"repeat", "times": {"none" | "steady": relative device times [N]},
     "candidates": {repeat: {"counts", "seconds": [...]}},
     "host_steal": {run name: the host's steal share during it, or None}}.
  """
  steps, passes = (20, 1) if quick else (CALIBRATION_STEPS, CALIBRATION_PASSES)
  units = config_lib.validate(base, jax.device_count(), jax.process_count()).model.num_units()
  even = {k: layout_lib.even_counts(u, 2) for k, u in units.items()}
  sched = speed.SchedShare() if speed.SchedShare.available() else None
  probe_times = None if sched is not None else _probe_times(base, core)
  times, steals = {}, {}
  for pattern in ("none", "steady"):
    name = f"even_{pattern}"
    seconds, relative, steals[name] = _timed_split(out, base, even, name, cache, core, pattern,
                                                   sched, steps)
    times[pattern] = relative if relative is not None else np.asarray(probe_times[pattern])
    print(f"[bench] calibration: even split, {pattern}: {seconds * 1e3:.1f} ms/step, speeds "
          f"{np.round(times[pattern].min() / times[pattern], 3).tolist()}"
          f"{_steal_note(steals[name])}", flush=True)
  speeds = times["steady"].min() / times["steady"]
  candidates = {r: {"counts": {k: split_counts(u, speeds, r) for k, u in units.items()},
                    "seconds": []} for r in CALIBRATION_REPEATS}
  for p in range(passes):
    for r in CALIBRATION_REPEATS[::1 if p % 2 == 0 else -1]:
      cand, name = candidates[r], f"{p}_repeat{r}"
      seconds, _, steals[name] = _timed_split(out, base, cand["counts"], name, cache, core,
                                              "steady", sched, steps)
      cand["seconds"].append(round(seconds, 5))
      print(f"[bench] calibration: repeat {r:.2f} split {cand['counts']}: "
            f"{seconds * 1e3:.1f} ms/step{_steal_note(steals[name])}", flush=True)
  repeat = min(CALIBRATION_REPEATS, key=lambda r: float(np.median(candidates[r]["seconds"])))
  print(f"[bench] repeated work: {repeat:.2f} of the block work per device "
        f"(the fastest time-balanced split under steady contention)", flush=True)
  worst = max((v for v in steals.values() if v is not None), default=None)
  if hostcpu.warning(worst):
    print(f"[bench] warning: {hostcpu.describe(worst, 'the worst calibration run')}", flush=True)
  return {"repeat": repeat, "times": {k: v.tolist() for k, v in times.items()},
          "candidates": {str(r): {"counts": {k: list(v) for k, v in c["counts"].items()},
                                  "seconds": c["seconds"]} for r, c in candidates.items()},
          "host_steal": steals}


def _steal_note(steal: float | None) -> str:
  """", host steal N%" for a console line, or "" where the host reports no steal time."""
  return "" if steal is None else f", host steal {steal:.0%}"


def run_real_worker(out: str, *, quick: bool, scenarios, policies, on_s: float, off_s: float,
                    rounds: int = ROUNDS, core: int = 1) -> None:
  """One process of the real-contention benchmark (see module doc); process 0 writes
  out/real_raw.json (after every run, so that a run cut short keeps what it measured)."""
  distributed.initialize()
  base = real_config(quick)
  cache: dict = {}
  fit = calibrate(out, base, cache, core, quick)
  t_off, t_on = np.asarray(fit["times"]["none"]), np.asarray(fit["times"]["steady"])
  times = {"none": t_off, "steady": t_on, "bursts": (on_s * t_on + off_s * t_off) / (on_s + off_s)}
  speeds = {k: v.min() / v for k, v in times.items()}
  runs = {s: {p: [] for p in policies} for s in scenarios}
  raw = {"mode": "real", "quick": quick, "rounds": rounds,
         "cost_fit": fit,
         "speeds": {k: v.tolist() for k, v in speeds.items()},
         "times": {k: v.tolist() for k, v in times.items()},
         "bursts": {"on_s": on_s, "off_s": off_s}, "config": json.loads(base.to_json()),
         "orders": rounds_lib.round_orders(policies, rounds), "runs": runs}
  for r, order in enumerate(raw["orders"]):
    for scenario in scenarios:
      scenario_base = real_config(quick, scenario)
      for position, policy in enumerate(order):
        config = policy_config(scenario_base, policy, speeds[scenario], seed=base.seed + r,
                               repeat=fit["repeat"], fit_repeat=False)
        workdir = os.path.join(out, "runs", scenario, policy, f"round{r}")
        if jax.process_index() == 0 and os.path.exists(workdir):
          shutil.rmtree(workdir)
        summary, injector, steal = _contended_run(config, workdir, cache, core, scenario, on_s,
                                                  off_s)
        extra = {"round": r, "position": position, "seed": config.seed, "host_steal": steal,
                 "contention": None if injector is None else injector.to_json()}
        record = _run_record(summary, workdir, extra)
        runs[scenario][policy].append(record)
        _print_run(scenario, policy, r, record)
        if jax.process_index() == 0:
          with open(os.path.join(out, "real_raw.json"), "w") as f:
            json.dump(raw, f)


# --- emulated slowdowns (one process, 8 fake devices) ------------------------------------------


def run_emulated(out: str, *, quick: bool, scenarios, policies, rounds: int = ROUNDS) -> dict:
  """Runs the emulated scenarios in this process (needs 8 devices); writes out/emulated_raw.json
  (after every run)."""
  cache: dict = {}
  runs = {s: {p: [] for p in policies} for s in scenarios}
  speeds = {}
  for scenario in scenarios:
    hetero = emulated_config(quick, scenario).hetero
    profile, rotating = np.asarray(hetero.slowdown, float), hetero.rotate_every
    # The oracle: proportional to the mean speed over the run (the rotation averages out).
    speeds[scenario] = (1.0 / (np.full_like(profile, profile.mean()) if rotating
                               else profile)).tolist()
  raw = {"mode": "emulated", "quick": quick, "rounds": rounds, "speeds": speeds,
         "orders": rounds_lib.round_orders(policies, rounds), "runs": runs,
         "profiles": {"static_profile": PROFILE, "rotating": ROTATING}}
  for r, order in enumerate(raw["orders"]):
    for scenario in scenarios:
      base = emulated_config(quick, scenario)
      for position, policy in enumerate(order):
        config = policy_config(base, policy, speeds[scenario], seed=base.seed + r)
        workdir = os.path.join(out, "runs", scenario, policy, f"round{r}")
        shutil.rmtree(workdir, ignore_errors=True)
        meter = hostcpu.StealMeter()
        summary = train.train_and_evaluate(config, workdir, engine_cache=cache)
        record = _run_record(summary, workdir, {"round": r, "position": position,
                                                "seed": config.seed,
                                                "host_steal": meter.share()})
        runs[scenario][policy].append(record)
        _print_run(scenario, policy, r, record)
        with open(os.path.join(out, "emulated_raw.json"), "w") as f:
          json.dump(raw, f)
  return raw


# --- results --------------------------------------------------------------------------------------


def median(values) -> float | None:
  """The median of the numbers in `values` (None entries count as +infinity: "never"); None if
  there are none, or if the median is infinite."""
  v = [math.inf if x is None else float(x) for x in values]
  if not v:
    return None
  m = float(np.median(v))
  return m if math.isfinite(m) else None


def spread(values) -> float | None:
  """max / min - 1 of `values` (the noise of repeated runs); None with fewer than two."""
  v = [float(x) for x in values if x is not None]
  return max(v) / min(v) - 1 if len(v) > 1 and min(v) > 0 else None


def time_to_loss(curve, target: float, tol: float = LOSS_TOL) -> float | None:
  """Training seconds until the validation loss first reached `target` (within `tol`,
  relative), interpolated linearly in time between evaluations; None if it never did.

  Args:
    curve: [[seconds, step, loss], ...] in step order (`val_curve`).
  """
  prev = None
  for t, _, loss in curve:
    if loss <= target * (1 + tol):     # reached: where the line between the points crosses it
      if prev is None or prev[1] <= loss:
        return float(t)
      t0, l0 = prev
      return float(t0 + (t - t0) * min(1.0, (l0 - target) / (l0 - loss)))
    prev = (t, loss)
  return None


def _by_round(runs: list) -> dict:
  return {r.get("round", i): r for i, r in enumerate(runs)}


def paired_ratios(runs: list, reference: list, key: str = "tokens_per_s") -> list[float]:
  """run / reference of `key` in every round both have (the paired per-round ratios)."""
  ref = _by_round(reference)
  return [r[key] / ref[k][key] for k, r in _by_round(runs).items()
          if k in ref and r.get(key) and ref[k].get(key)]


def times_to_reference_loss(runs: list, reference: list) -> list[float | None]:
  """For each run, seconds to reach the final validation loss of the reference run of its round
  (`time_to_loss`); rounds without a reference run use the median of the reference's losses."""
  ref = _by_round(reference)
  fallback = median([r["final_val_loss"] for r in reference])
  out = []
  for k, r in _by_round(runs).items():
    target = ref[k]["final_val_loss"] if k in ref else fallback
    curve = r.get("val_curve") or []
    out.append(None if target is None or not curve else time_to_loss(curve, target))
  return out


def median_run(runs: list) -> dict:
  """The run of median tokens/s (the upper one of an even count); {} without runs."""
  if not runs:
    return {}
  return runs[int(np.argsort([r["tokens_per_s"] for r in runs], kind="stable")[len(runs) // 2])]


def _as_list(cell) -> list:
  return cell if isinstance(cell, list) else [cell]


def summarize_cell(runs: list, even: list, oracle: list) -> dict:
  """The results of one (scenario, policy) cell from its runs and those of `even` and of the
  oracle in the same scenario (see the module doc; ratios None where a reference is missing)."""
  tps = [r["tokens_per_s"] for r in runs]
  losses = [r["final_val_loss"] for r in runs]
  even_tps, oracle_tps = median([r["tokens_per_s"] for r in even]), median(
      [r["tokens_per_s"] for r in oracle])
  even_loss = median([r["final_val_loss"] for r in even])
  even_mean = float(np.mean([r["final_val_loss"] for r in even])) if even else None
  reach = times_to_reference_loss(runs, even) if even else [None] * len(runs)
  even_reach = dict(zip(_by_round(even), times_to_reference_loss(even, even))) if even else {}
  # even's time / this run's, per round (0 for a run that never got there).
  speedups = [even_reach[k] / t if t else 0.0 for k, t in zip(_by_round(runs), reach)
              if even_reach.get(k)]
  typical = median_run(runs)
  tps_med = median(tps)
  steals = [r["host_steal"] for r in runs if r.get("host_steal") is not None]
  ratio = lambda a, b: a / b if a is not None and b else None
  return {
      "tokens_per_s": tps_med, "tokens_per_s_min": min(tps), "tokens_per_s_max": max(tps),
      "tokens_per_s_spread": spread(tps),
      "ratio_vs_even": ratio(tps_med, even_tps), "ratio_vs_oracle": ratio(tps_med, oracle_tps),
      "paired_ratio_vs_even": median(paired_ratios(runs, even)) if even else None,
      "paired_ratio_vs_oracle": median(paired_ratios(runs, oracle)) if oracle else None,
      "final_val_loss": median(losses), "final_val_loss_mean": float(np.mean(losses)),
      "final_val_loss_std": float(np.std(losses)),
      "val_loss_vs_baseline": ratio(median(losses), even_loss) - 1 if even_loss else None,
      "mean_val_loss_vs_baseline": float(np.mean(losses)) / even_mean - 1 if even_mean else None,
      "time_to_even_loss_s": median(reach),
      "reached_even_loss": sum(t is not None for t in reach),
      "time_to_even_loss_speedup": median(speedups) or None,
      "compiles_after_warmup": max(r["compiles_after_warmup"] for r in runs),
      "migrations": median([r["migrations"] for r in runs]),
      "decisions": median([r["decisions"] for r in runs]),
      "measure_overhead": median([r["measure_overhead"] for r in runs
                                  if r.get("measure_overhead") is not None]),
      "host_steal": median(steals), "host_steal_max": max(steals, default=None),
      "final_counts": typical.get("final_counts"), "changes": typical.get("changes", []),
      "runs": [{"round": r.get("round", i), "position": r.get("position"), "seed": r.get("seed"),
                "tokens_per_s": r["tokens_per_s"], "final_val_loss": r["final_val_loss"],
                "time_to_even_loss_s": t, "host_steal": r.get("host_steal"),
                "migrations": r["migrations"],
                "compiles_after_warmup": r["compiles_after_warmup"],
                "final_counts": r.get("final_counts")}
               for i, (r, t) in enumerate(zip(runs, reach))]}


def summarize(raw: dict) -> dict:
  """{SCENARIO: {POLICY: summarize_cell(...)}} from raw runs ({SCENARIO: {POLICY: [run, ...]}};
  a single run dict counts as a list of one). `even` of the same scenario is the baseline of
  speed and loss, `static` the oracle."""
  out = {}
  for scenario, cells in raw["runs"].items():
    cells = {p: _as_list(c) for p, c in cells.items() if c}
    even, oracle = cells.get("even", []), cells.get("static", [])
    out[scenario] = {p: summarize_cell(runs, even, oracle) for p, runs in cells.items()}
  return out


def noise(results: dict) -> dict:
  """{scenario: spread of `even`'s tokens/s over its repeated runs} (the noise of one run);
  None where `even` ran fewer than twice."""
  return {s: cells["even"]["tokens_per_s_spread"] for s, cells in results.items()
          if "even" in cells}


def host_steal(results: dict) -> dict:
  """{scenario: {"median", "max"}}: the share of the host's CPU time the hypervisor took
  (`hostcpu`) during the runs of every policy of each scenario; scenarios whose runs have no
  steal figure (not Linux) are left out."""
  out = {}
  for scenario, cells in results.items():
    steals = [r["host_steal"] for c in cells.values() for r in c["runs"]
              if r.get("host_steal") is not None]
    if steals:
      out[scenario] = {"median": median(steals), "max": max(steals)}
  return out


def noise_line(results: dict) -> str:
  """One markdown line: the spread of the repeated `even` runs of every scenario, and the
  host's steal share during the runs, with a warning where it passed `hostcpu.STEAL_WARN`."""
  parts = [f"{s} {'–' if v is None else format(v, '.0%')}" for s, v in noise(results).items()]
  runs = max((len(c["even"]["runs"]) for c in results.values() if "even" in c), default=0)
  line = (f"- noise: `even` ran {runs}x per scenario; its tokens/s spread (max / min - 1): "
          f"{', '.join(parts)}. Ratios are of medians; paired ratios compare runs of one round.")
  steal = host_steal(results)
  if steal:
    line += ("\n- host: the hypervisor took this share of the host's CPU time during the runs "
             "(median, max): " + ", ".join(f"{s} {v['median']:.0%}, {v['max']:.0%}"
                                          for s, v in steal.items()) + ".")
    alarm = hostcpu.warning(max(v["max"] for v in steal.values()))
    line += f" **{alarm}**" if alarm else ""
  return line


def markdown(results: dict, title: str) -> str:
  fmt = report.fmt
  lines = [f"### {title}", "",
           "| scenario | policy | tokens/s (median) | spread | vs even | paired vs even "
           "| vs oracle | paired vs oracle | s to even's loss (even's s / it) | val loss (mean) "
           "| vs even | compiles after warm-up | migrations | host steal |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for scenario, runs in results.items():
    for policy, r in runs.items():
      reached = r["reached_even_loss"]
      reach = (f"{r['time_to_even_loss_s']:.1f} ({fmt(r['time_to_even_loss_speedup'], '.2f')}x)"
               if r["time_to_even_loss_s"] is not None
               else f"not reached ({reached}/{len(r['runs'])})")
      lines.append(
          f"| {scenario} | {policy} | {r['tokens_per_s']:.0f} "
          f"| {fmt(r['tokens_per_s_spread'], '.0%')} | {fmt(r['ratio_vs_even'], '.2f')} "
          f"| {fmt(r['paired_ratio_vs_even'], '.2f')} | {fmt(r['ratio_vs_oracle'], '.2f')} "
          f"| {fmt(r['paired_ratio_vs_oracle'], '.2f')} | {reach} "
          f"| {r['final_val_loss_mean']:.4f} | {fmt(r['mean_val_loss_vs_baseline'], '+.2%')} "
          f"| {r['compiles_after_warmup']} | {fmt(r['migrations'], 'g')} "
          f"| {fmt(r.get('host_steal'), '.0%')} |")
  return "\n".join(lines) + "\n"


# (part, scenario, policy, key, comparison, bound, what): the issue's targets on medians.
TARGETS = (
    ("scenarios", "steady", "semi", "ratio_vs_oracle", ">=", 0.95, "semi vs oracle"),
    ("scenarios", "steady", "semi", "ratio_vs_even", ">=", 1.3, "semi vs even"),
    ("scenarios", "steady", "static", "ratio_vs_even", ">=", 1.42, "oracle vs even"),
    ("scenarios", "bursts", "semi", "ratio_vs_even", ">=", 1.15, "semi vs even"),
    ("scenarios", "bursts", "semi", "ratio_vs_oracle", ">=", 1.0, "semi vs static oracle"),
    ("scenarios", "none", "semi", "ratio_vs_even", ">=", 0.98, "semi vs even"),
    ("scenarios", "steady", "semi", "mean_val_loss_vs_baseline", "<=", 0.005,
     "semi mean val loss vs even"),
    ("scenarios", "bursts", "semi", "mean_val_loss_vs_baseline", "<=", 0.005,
     "semi mean val loss vs even"),
    ("emulated", "static_profile", "semi", "ratio_vs_oracle", ">=", 0.95, "semi vs oracle"),
    ("emulated", "rotating", "semi", "ratio_vs_oracle", ">=", 0.95, "semi vs oracle"),
)


def target_lines(results: dict) -> list[str]:
  """One markdown line per target whose cell was run: its value (and the paired one for
  ratios), the bound, met or not met."""
  lines = []
  for part, scenario, policy, key, op, bound, what in TARGETS:
    cell = results.get(part, {}).get(scenario, {}).get(policy)
    if cell is None:
      continue
    v = cell.get(key)
    if v is None:
      lines.append(f"- {scenario}: {what} ({key}) = – (target {op} {bound:g}): not measured")
      continue
    met = v >= bound if op == ">=" else v <= bound
    paired = cell.get(key.replace("ratio_vs", "paired_ratio_vs"))
    extra = f", paired {paired:.2f}" if key.startswith("ratio_vs") and paired is not None else ""
    shown = f"{v:+.2%}" if key.endswith("baseline") else f"{v:.2f}"
    goal = f"{bound:+.1%}" if key.endswith("baseline") else f"{bound:g}"
    lines.append(f"- {scenario}: {what} ({key}) = {shown}{extra} (target {op} {goal}): "
                 f"{'met' if met else 'NOT met'}")
  return lines


def plot(raw: dict, path: str, title: str) -> None:
  """Per scenario: throughput over time (left; one line per policy, its median run, contention
  periods shaded) and validation loss over training time (right, every run). Skipped when
  matplotlib is not installed."""
  plt = report.pyplot()
  if plt is None:
    return
  scenarios = list(raw["runs"])
  fig, axes = plt.subplots(len(scenarios), 2, figsize=(13, 2.8 * len(scenarios)), squeeze=False,
                           gridspec_kw={"width_ratios": [2, 1]})
  for (ax, lax), scenario in zip(axes, scenarios):
    shaded = False
    for i, (policy, cell) in enumerate(raw["runs"][scenario].items()):
      runs = _as_list(cell)
      if not runs:
        continue
      color = f"C{i}"
      r = median_run(runs)
      dt = np.asarray(r["step_times_s"])
      if len(dt):
        t = np.cumsum(dt)
        tokens = r["tokens_per_s"] * np.sum(dt) / len(dt)          # tokens per step (constant)
        k = min(5, len(dt))       # trailing mean of k steps (no zero padding at the ends)
        smooth = np.convolve(tokens / dt, np.ones(k) / k, mode="valid")
        ax.plot(t[k - 1:], smooth, label=policy, lw=1.2, color=color)
        c = r.get("contention")
        if c and not shaded and policy == "semi":
          for a, b in c["intervals"]:
            ax.axvspan(a, b, color="grey", alpha=0.15, lw=0)
          shaded = True
      for j, run in enumerate(runs):
        curve = np.asarray(run.get("val_curve") or [], np.float64).reshape(-1, 3)
        lax.plot(curve[:, 0], curve[:, 2], color=color, lw=1, alpha=0.8,
                 label=policy if j == 0 else None)
    ax.set_title(f"{scenario}: median run" + (" (shaded: competitor on, semi's run)"
                                              if shaded else ""), fontsize=9)
    ax.set_ylabel("tokens/s")
    finals = [r["final_val_loss"] for c in raw["runs"][scenario].values() for r in _as_list(c)]
    if finals:      # the last stretch, where the policies differ
      lax.set_ylim(min(finals) * 0.995, min(finals) * 1.08)
    lax.set_title(f"{scenario}: validation loss, every run", fontsize=9)
    lax.set_ylabel("val loss")
  axes[-1, 0].set_xlabel("seconds since the first step")
  axes[-1, 1].set_xlabel("training seconds")
  axes[0, 0].legend(ncol=6, fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
