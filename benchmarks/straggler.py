"""The straggler benchmark: every balancing policy under real and emulated slow devices.

Real contention (`run_real_worker`, one of 2 processes started by `launch`): two processes, one
CPU device each (`tensor` = 2), pinned to their own cores, train gpt_tiny; a competing CPU-bound
process (`contention.Injector`) shares the core of process 1: never (`none`), the whole time
(`steady`) or on/off (`bursts`). Process 0 starts the competitor right after each run's warm-up
and stops it after the run. Before the runs, the speed probe measures both devices with and
without the competitor; the `static` oracle of a scenario is the split proportional to those
speeds (for bursts, to the time-weighted mean of the two).

Emulated slowdowns (`run_emulated`, one process, 8 fake devices): the authors' static profile
(8, 6, 4, 2, 1, 1, 1, 1) and their rotating straggler (8 on one device, moving every few steps).

Each run trains the same model from the same seed for the same number of steps, so final
validation losses are comparable with the `none` / `even` run. `summarize` turns the raw runs
into the results: tokens/s, ratios to `even` and to the oracle (`static`) of the same scenario,
final validation loss and its difference to the baseline, compilations after warm-up, and the
controller's decisions.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time

import jax
import numpy as np

from benchmarks import report
from semijax.balance import speed
from semijax.core import layout as layout_lib
from semijax.runtime import contention
from semijax.runtime import distributed
from semijax.train import config as config_lib
from semijax.train import loop as train

SCENARIOS = ("none", "steady", "bursts")
EMULATED = ("static_profile", "rotating")
POLICIES = ("even", "static", "resize", "migrate", "offload", "semi")
PROFILE = (8.0, 6.0, 4.0, 2.0, 1.0, 1.0, 1.0, 1.0)
ROTATING = (8.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0)
SAME_SPEED = 0.9     # oracle speeds all at least this (relative): the cores are equal


def _bench_config(arg: str, steps: int, log_every: int, num_widths: int):
  """gpt_tiny (config argument `arg`) for benchmark runs: one evaluation at the end, no
  checkpoints but the last, `num_widths` compute widths in the dynamic policies' bucket."""
  c = config_lib.load(os.path.join(_root(), "configs", "gpt_tiny.py") + ":" + arg)
  c.steps = steps
  c.eval_every = steps
  c.log_every = log_every
  c.checkpoint_every = 0
  c.keep_checkpoints = 1
  c.balance.num_widths = num_widths
  return c


def real_config(quick: bool):
  """gpt_tiny on 2 tensor devices (one per process), sized so compute dominates communication."""
  c = _bench_config("cpu,tensor=2", 40 if quick else 300, log_every=20, num_widths=6)
  c.model.d_model, c.model.d_ff, c.model.num_layers = 256, 1024, 2
  c.batch_size = 16       # smaller batches leave the split less to win (collective latency)
  c.balance.probe_every = 2   # react within a few steps: the quick bursts last 4 s
  c.balance.capacity_factor = 1.5   # up to 768 of 1024 units: room for a 3:1 split, less padding
  return c


def emulated_config(quick: bool, scenario: str):
  """gpt_tiny on 8 fake devices with an emulated slowdown profile."""
  c = _bench_config("cpu", 16 if quick else 90, log_every=8, num_widths=8)
  c.model.num_layers = 1
  c.hetero.slowdown = PROFILE if scenario == "static_profile" else ROTATING
  c.hetero.rotate_every = 0 if scenario == "static_profile" else (4 if quick else 15)
  return c


def policy_config(base, policy: str, oracle_speeds):
  """`base` for one policy; `static` gets the split proportional to `oracle_speeds` (the
  oracle; even when every speed is within `SAME_SPEED` of the fastest, as for two idle cores
  measured with noise), which compiles exactly its own widths."""
  c = copy.deepcopy(base)
  c.balance.policy = policy
  if oracle_speeds is not None and min(oracle_speeds) >= SAME_SPEED:
    oracle_speeds = [1.0] * len(oracle_speeds)     # equal cores measured with noise: even split
  if policy == "static":     # in granules of 1/64 of the units: odd GEMM widths run slower on CPU
    for kind, units in (("mlp", c.model.d_ff), ("heads", c.model.num_heads)):
      g = max(1, units // 64) if units % max(1, units // 64) == 0 else 1
      c.layout[kind] = tuple(g * n for n in layout_lib.proportional_counts(units // g,
                                                                           oracle_speeds))
  return c


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_record(summary: dict, workdir: str, extra: dict) -> dict:
  """What the results keep of one run."""
  decisions = []
  path = os.path.join(workdir, "decisions.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      decisions = [json.loads(line) for line in f]
  changed = [{k: d[k] for k in ("step", "choice", "reason", "owned", "keep")}
             for d in decisions if d["changed"]]
  b = summary["balance"]
  dt = np.asarray(summary["step_times_s"])
  tokens_per_step = summary["tokens_per_s"] * summary["mean_step_time_s"]
  return {"tokens_per_s": float(len(dt) * tokens_per_step / dt.sum()),   # all steps, all costs
          "final_val_loss": summary["val/loss"], "compiles_after_warmup": b["compiles_after_warmup"],
          "migrations": b["migrations"], "decisions": b.get("decisions", 0),
          "changes": changed[:40], "measure_overhead": b.get("measure_overhead"),
          "step_times_s": [round(t, 5) for t in dt.tolist()],
          "final_counts": b["layout_counts"], **extra}


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


def run_real_worker(out: str, *, quick: bool, scenarios, policies, on_s: float, off_s: float,
                    core: int = 1) -> None:
  """One process of the real-contention benchmark (see module doc); process 0 writes
  out/real_raw.json."""
  distributed.initialize()
  jax.config.update("jax_compilation_cache_dir", os.path.join(out, ".jax_cache"))
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  base = real_config(quick)
  probe = speed.Probe(base.balance.probe_size, base.balance.probe_repeats)
  probe.warm_up()
  t_off, ids = measure_speeds(probe, core, "none", 2.0)
  t_on, _ = measure_speeds(probe, core, "steady", 3.0)
  times = {"none": t_off, "steady": t_on, "bursts": (on_s * t_on + off_s * t_off) / (on_s + off_s)}
  speeds = {k: v.min() / v for k, v in times.items()}
  cache: dict = {}
  runs = {}
  for scenario in scenarios:
    runs[scenario] = {}
    for policy in policies:
      config = policy_config(base, policy, speeds[scenario])
      workdir = os.path.join(out, "runs", scenario, policy)
      if jax.process_index() == 0 and os.path.exists(workdir):
        shutil.rmtree(workdir)
      injector = None
      if jax.process_index() == 0 and scenario != "none":
        injector = contention.Injector(core, "steady" if scenario == "steady" else "bursts",
                                       on_s=on_s, off_s=off_s)
      try:
        summary = train.train_and_evaluate(
            config, workdir, engine_cache=cache,
            after_warmup=None if injector is None else injector.start)
      finally:
        if injector is not None:
          injector.stop()
      extra = {"contention": None if injector is None else injector.to_json()}
      runs[scenario][policy] = _run_record(summary, workdir, extra)
      print(f"[bench] {scenario:7s} {policy:8s} {runs[scenario][policy]['tokens_per_s']:9.1f} "
            f"tok/s  val {summary['val/loss']:.4f}", flush=True)
  if jax.process_index() == 0:
    raw = {"mode": "real", "quick": quick, "probe_device_ids": ids,
           "speeds": {k: v.tolist() for k, v in speeds.items()},
           "probe_times_s": {k: v.tolist() for k, v in times.items()},
           "bursts": {"on_s": on_s, "off_s": off_s}, "config": json.loads(base.to_json()),
           "runs": runs}
    with open(os.path.join(out, "real_raw.json"), "w") as f:
      json.dump(raw, f)


# --- emulated slowdowns (one process, 8 fake devices) ------------------------------------------


def run_emulated(out: str, *, quick: bool, scenarios, policies) -> dict:
  """Runs the emulated scenarios in this process (needs 8 devices); writes out/emulated_raw.json."""
  cache: dict = {}
  runs, speeds = {}, {}
  for scenario in scenarios:
    base = emulated_config(quick, scenario)
    profile = np.asarray(base.hetero.slowdown, float)
    # The oracle: proportional to the mean speed over the run (the rotation averages out).
    mean_slowdown = profile if not base.hetero.rotate_every else np.full_like(profile,
                                                                              profile.mean())
    speeds[scenario] = (1.0 / mean_slowdown).tolist()
    runs[scenario] = {}
    for policy in policies:
      config = policy_config(base, policy, speeds[scenario])
      workdir = os.path.join(out, "runs", scenario, policy)
      shutil.rmtree(workdir, ignore_errors=True)
      summary = train.train_and_evaluate(config, workdir, engine_cache=cache)
      runs[scenario][policy] = _run_record(summary, workdir, {})
      print(f"[bench] {scenario:14s} {policy:8s} {runs[scenario][policy]['tokens_per_s']:9.1f} "
            f"tok/s  val {summary['val/loss']:.4f}", flush=True)
  raw = {"mode": "emulated", "quick": quick, "speeds": speeds, "runs": runs,
         "profiles": {"static_profile": PROFILE, "rotating": ROTATING}}
  with open(os.path.join(out, "emulated_raw.json"), "w") as f:
    json.dump(raw, f)
  return raw


# --- results --------------------------------------------------------------------------------------


def summarize(raw: dict, baseline: tuple[str, str]) -> dict:
  """{SCENARIO: {POLICY: {tokens_per_s, ratio_vs_even, ratio_vs_oracle, final_val_loss,
  val_loss_vs_baseline, compiles_after_warmup, ...}}} from raw runs; the oracle is `static`
  and the baseline loss is the run `baseline` = (scenario, policy)."""
  base_loss = raw["runs"].get(baseline[0], {}).get(baseline[1], {}).get("final_val_loss")
  out = {}
  for scenario, runs in raw["runs"].items():
    even = runs.get("even", {}).get("tokens_per_s")
    oracle = runs.get("static", {}).get("tokens_per_s")
    out[scenario] = {}
    for policy, r in runs.items():
      tps = r["tokens_per_s"]
      out[scenario][policy] = {
          "tokens_per_s": tps,
          "ratio_vs_even": tps / even if even else None,
          "ratio_vs_oracle": tps / oracle if oracle else None,
          "final_val_loss": r["final_val_loss"],
          "val_loss_vs_baseline": (r["final_val_loss"] / base_loss - 1) if base_loss else None,
          "compiles_after_warmup": r["compiles_after_warmup"],
          "migrations": r["migrations"], "decisions": r["decisions"],
          "measure_overhead": r["measure_overhead"], "final_counts": r["final_counts"],
          "changes": r["changes"]}
  return out


# Policies that run the even split when nobody is slow (offload runs its own step).
SAME_SPLIT_POLICIES = ("even", "static", "resize", "migrate", "semi")


def same_split_runs(results: dict, scenario: str = "none") -> dict:
  """{policy: result} of `scenario`'s runs of `SAME_SPLIT_POLICIES` (in `none`, with an even
  oracle, they all train the same split)."""
  return {p: r for p, r in results.get(scenario, {}).items() if p in SAME_SPLIT_POLICIES}


def noise_spread(results: dict, scenario: str = "none") -> float | None:
  """max / min - 1 of tokens/s over `same_split_runs` (the noise of one run); None with fewer
  than two such runs."""
  tps = [r["tokens_per_s"] for r in same_split_runs(results, scenario).values()]
  return max(tps) / min(tps) - 1 if len(tps) > 1 else None


def markdown(results: dict, title: str) -> str:
  lines = [f"### {title}", "",
           "| scenario | policy | tokens/s | vs even | vs oracle | final val loss | vs baseline "
           "| compiles after warm-up | migrations |", "|---|---|---|---|---|---|---|---|---|"]
  fmt = lambda v, f: "–" if v is None else format(v, f)
  for scenario, runs in results.items():
    for policy, r in runs.items():
      lines.append(
          f"| {scenario} | {policy} | {r['tokens_per_s']:.0f} | {fmt(r['ratio_vs_even'], '.2f')} "
          f"| {fmt(r['ratio_vs_oracle'], '.2f')} | {r['final_val_loss']:.4f} "
          f"| {fmt(r['val_loss_vs_baseline'], '+.2%')} | {r['compiles_after_warmup']} "
          f"| {r['migrations']} |")
  return "\n".join(lines) + "\n"


def plot(raw: dict, path: str, title: str) -> None:
  """Throughput over time per scenario (one line per policy), contention periods shaded.
  Skipped when matplotlib is not installed."""
  plt = report.pyplot()
  if plt is None:
    return
  scenarios = list(raw["runs"])
  fig, axes = plt.subplots(len(scenarios), 1, figsize=(9, 2.8 * len(scenarios)), squeeze=False)
  for ax, scenario in zip(axes[:, 0], scenarios):
    shaded = False
    for policy, r in raw["runs"][scenario].items():
      dt = np.asarray(r["step_times_s"])
      if not len(dt):
        continue
      t = np.cumsum(dt)
      tokens = r["tokens_per_s"] * np.sum(dt) / len(dt)          # tokens per step (constant)
      k = min(5, len(dt))       # trailing mean of k steps (no zero padding at the ends)
      smooth = np.convolve(tokens / dt, np.ones(k) / k, mode="valid")
      ax.plot(t[k - 1:], smooth, label=policy, lw=1.2)
      c = r.get("contention")
      if c and not shaded and policy == "semi":
        for a, b in c["intervals"]:
          ax.axvspan(a, b, color="grey", alpha=0.15, lw=0)
        shaded = True
    ax.set_title(f"{scenario}" + (" (shaded: competitor running, semi's run)" if shaded else ""),
                 fontsize=9)
    ax.set_ylabel("tokens/s")
  axes[-1, 0].set_xlabel("seconds since the first step")
  axes[0, 0].legend(ncol=6, fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
