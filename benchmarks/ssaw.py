"""The SSAW study: how data-parallel replicas of unequal speed should combine their gradients.

Every run trains one model from one seed on the same samples (steps x batch_size, in the same
order) under one sync variant (`VARIANTS`: sync, ssaw, async, local_sgd, and ssaw with the
alternative weighting rule), and records its validation loss against training seconds.

Real contention (`run_real_worker`, one of 2 processes started by `launch`): one replica per
process, one CPU device each, pinned to cores 0 and 1; a competing CPU-bound process
(`contention.Injector`) shares core 1 the whole time (`steady`) or on/off (`bursts`). Process 0
starts the competitor right after each run's warm-up and stops it after the run.

Emulated (`run_emulated`, one process, 8 fake devices): 4 or 8 replicas, one or two of them 2x
or 4x slower (`EMULATED`), each replica a tensor group whose nominal compute is emulated
(`hetero.device_gflops` chosen so that a nominal microbatch takes `EMULATED_STEP_S`), so that
the emulated time, not this machine's real compute, dominates a step.

Every cell (model, setting, variant) runs `ROUNDS` times in interleaved rounds: round r trains
from seed r, every variant once, in an order rotated from round to round. `summarize` gives per
cell: median throughput (samples/s) with its spread, final validation loss and accuracy (mean
over the seeds) and their difference to sync's, and the time to reach sync's final validation
loss of the same seed (median, and the median of the paired ratios to sync's own time).
"""

from __future__ import annotations

import copy
import json
import os
import shutil

import jax
import numpy as np

from benchmarks import report
from benchmarks import rounds as rounds_lib
from benchmarks import straggler as straggler_lib
from semijax.core import emulation
from semijax.core import plan as plan_lib
from semijax.runtime import contention
from semijax.runtime import distributed
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics as metrics_lib

MODELS = ("gpt_tiny", "vit_digits")
VARIANTS = {
    "sync": {"mode": "sync"},
    "ssaw": {"mode": "ssaw"},
    # The alternative rule: the learning rate scaled by the square root of the round's covered
    # (staleness-discounted) share of a batch, instead of a full step every round.
    "ssaw_sqrt_lr": {"mode": "ssaw", "lr_batch_power": 0.5},
    "async": {"mode": "async"},
    "local_sgd": {"mode": "local_sgd"},
}
REAL_VARIANTS = ("sync", "ssaw", "async", "local_sgd")
REAL = ("steady", "bursts")
EMULATED = {
    "4x1_slow2": (1.0, 1.0, 1.0, 2.0),
    "4x1_slow4": (1.0, 1.0, 1.0, 4.0),
    "4x2_slow2": (1.0, 1.0, 2.0, 2.0),
    "8x1_slow4": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 4.0),
    "8x2_slow2_4": (1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0),
}
# (8 replicas with two 4x slow ones would train exactly what 4 with one does: the same share of
# the samples, in the same rounds, at the same staleness.)
QUICK_EMULATED = ("4x1_slow2", "8x2_slow2_4")
ROUNDS = 3
QUICK_STEPS, STEPS = 20, 120   # the sample budget: steps x batch_size (emulated)
QUICK_REAL_STEPS, REAL_STEPS = 16, 120
EMULATED_STEP_S = 0.08    # emulated seconds of a nominal replica's microbatch
EVALS_PER_RUN = 6
# Every variant but sync trains on past the sample budget (at the schedule's final rate) by
# this factor, so that the time to reach sync's final loss is measured even where it takes a
# few more samples; its figures at the budget itself come from its curve.
EXTEND = 1.25


def _root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def model_config(model: str, *, replicas: int, tensor: int, steps: int):
  """The `:cpu` variant of configs/<model>.py for study runs: `EVALS_PER_RUN` evaluations, one
  checkpoint at the end, 8 local steps between local SGD's averages."""
  c = config_lib.load(os.path.join(_root(), "configs", f"{model}.py") +
                      f":cpu,tensor={tensor},data={replicas}")
  c.steps = steps
  c.eval_every = max(1, steps // EVALS_PER_RUN)
  c.log_every = steps
  c.checkpoint_every = 0
  c.keep_checkpoints = 1
  c.optimizer.warmup_steps = max(1, steps // 10)
  if model == "gpt_tiny":
    c.data.eval_batches = 2
  return c


def emulated_config(model: str, setting: str, quick: bool):
  """`model` on 8 fake devices: len(EMULATED[setting]) replicas x (8 / that) tensor devices."""
  slowdown = EMULATED[setting]
  r = len(slowdown)
  c = model_config(model, replicas=r, tensor=8 // r, steps=QUICK_STEPS if quick else STEPS)
  c.hetero.replica_slowdown = slowdown
  c.hetero.device_gflops = nominal_gflops(c, EMULATED_STEP_S)
  return c


def nominal_gflops(config, step_s: float) -> float:
  """The emulated FLOP rate at which a replica's even tensor split computes one microbatch
  (forward + backward) in `step_s` seconds."""
  run = config_lib.validate(config)
  tokens = run.batch_size // run.mesh.data * run.model.seq_len
  unit_ms = emulation.unit_ms(run.model.flops_per_unit(), tokens, 1.0)
  executed = plan_lib.executed_widths(run.layout, run.model.num_layers)
  ms = sum(float((unit_ms[k] * np.asarray(e)).max(axis=0).sum()) for k, e in executed.items())
  return ms / 1e3 / step_s


def real_config(model: str, quick: bool):
  """`model` with one replica per process (2 processes, one CPU device each)."""
  return model_config(model, replicas=2, tensor=1,
                      steps=QUICK_REAL_STEPS if quick else REAL_STEPS)


def variant_config(base, variant: str, seed: int):
  """`base` under `variant` from `seed`; every variant but sync trains EXTEND x the samples, on
  the budget's schedule."""
  c = copy.deepcopy(base)
  c.seed = seed
  for key, value in VARIANTS[variant].items():
    c.sync[key] = value
  if variant != "sync":
    c.optimizer.schedule_steps = base.steps
    c.steps = int(round(base.steps * EXTEND))
  return c


def at_samples(curve, samples: float, column: int) -> float:
  """`column` of a curve ([[seconds, samples, loss, accuracy], ...]) at `samples`, interpolated
  linearly between the points around it (the last point's if none is that far)."""
  c = np.asarray(curve, np.float64)
  if samples >= c[-1, 1]:
    return float(c[-1, column])
  return float(np.interp(samples, c[:, 1], c[:, column]))


# --- one run ------------------------------------------------------------------------------------


def _curve(summary: dict, workdir: str) -> list[list[float]]:
  """[[training seconds, samples, val loss, val accuracy], ...] of a run."""
  if "sync" in summary:                      # a replica mode keeps its own curve
    return [list(map(float, p)) for p in summary["sync"]["curve"]]
  records = metrics_lib.read_jsonl(os.path.join(workdir, metrics_lib.JSONL_NAME))
  vals = {r["step"]: r for r in records if "val/loss" in r}
  clock = np.concatenate([[0.0], np.cumsum(summary["step_times_s"])])
  batch = summary["samples_per_step"]
  return [[float(clock[s]), float(s * batch), float(v["val/loss"]), float(v["val/accuracy"])]
          for s, v in sorted(vals.items())]


def run_one(config, workdir: str, cache: dict, budget: int, after_warmup=None) -> dict:
  """Trains one run from scratch in `workdir`; returns its record, its figures taken at
  `budget` samples."""
  if jax.process_index() == 0 and os.path.exists(workdir):
    shutil.rmtree(workdir)
  summary = train.train_and_evaluate(config, workdir, engine_cache=cache,
                                     after_warmup=after_warmup)
  summary["samples_per_step"] = config.batch_size
  curve = _curve(summary, workdir)
  seconds = at_samples(curve, budget, 0)
  return {"seed": config.seed, "curve": curve, "seconds": seconds,
          "samples_per_s": budget / seconds if seconds else 0.0,
          "final_val_loss": at_samples(curve, budget, 2),
          "final_val_accuracy": at_samples(curve, budget, 3),
          "samples": budget, "trained_samples": config.steps * config.batch_size,
          "updates": int(summary["steps"])}


def _print_run(part: str, model: str, setting: str, variant: str, rec: dict) -> None:
  print(f"[ssaw] {part} {model} {setting} {variant:12s} seed {rec['seed']} "
        f"{rec['samples_per_s']:8.1f} samples/s  {rec['seconds']:6.2f} s  "
        f"val {rec['final_val_loss']:.4f}  updates {rec['updates']}", flush=True)


def _cells(models, settings, variants, rounds, make_config, run, part):
  """{model: {setting: {variant: [record per round]}}}, rounds interleaved (order rotated)."""
  out: dict = {}
  for model in models:
    for setting in settings:
      cell = out.setdefault(model, {}).setdefault(setting, {v: [] for v in variants})
      for r, order in enumerate(rounds_lib.round_orders(variants, rounds)):
        for variant in order:
          base = make_config(model, setting)
          rec = run(variant_config(base, variant, r), model, setting, variant, r,
                    base.steps * base.batch_size)
          rec["round"] = r
          cell[variant].append(rec)
          _print_run(part, model, setting, variant, rec)
  return out


def run_emulated(out: str, *, quick: bool, models, settings, variants,
                 rounds: int = ROUNDS) -> dict:
  """The emulated part, in this process (8 devices); writes out/emulated_raw.json."""
  cache: dict = {}

  def run(config, model, setting, variant, r, budget):
    return run_one(config, os.path.join(out, "runs", "emulated", model, setting, variant, str(r)),
                   cache, budget)

  runs = _cells(models, settings, variants, rounds,
                lambda m, s: emulated_config(m, s, quick), run, "emulated")
  raw = {"part": "emulated", "quick": quick, "settings": {s: EMULATED[s] for s in settings},
         "step_s": EMULATED_STEP_S, "runs": runs}
  with open(os.path.join(out, "emulated_raw.json"), "w") as f:
    json.dump(raw, f)
  return raw


def run_real_worker(out: str, *, quick: bool, models, scenarios, variants, on_s: float,
                    off_s: float, rounds: int = ROUNDS, core: int = 1) -> None:
  """One of the 2 processes of the real-contention part; process 0 writes out/real_raw.json.
  Runs the variants of `REAL_VARIANTS` among `variants`."""
  variants = [v for v in variants if v in REAL_VARIANTS]
  distributed.initialize()
  cache: dict = {}

  def run(config, model, scenario, variant, r, budget):
    injector = None
    if jax.process_index() == 0:
      injector = contention.Injector(core, scenario, on_s=on_s, off_s=off_s)
    try:
      rec = run_one(config, os.path.join(out, "runs", "real", model, scenario, variant, str(r)),
                    cache, budget, after_warmup=None if injector is None else injector.start)
    finally:
      if injector is not None:
        injector.stop()
    rec["contention"] = None if injector is None else injector.to_json()
    return rec

  runs = _cells(models, scenarios, variants, rounds, lambda m, s: real_config(m, quick), run,
                "real")
  if jax.process_index() == 0:
    raw = {"part": "real", "quick": quick, "bursts": {"on_s": on_s, "off_s": off_s},
           "runs": runs}
    with open(os.path.join(out, "real_raw.json"), "w") as f:
      json.dump(raw, f)


# --- results ------------------------------------------------------------------------------------


def summarize_cell(runs: dict) -> dict:
  """{variant: figures} of one (model, setting): medians over the rounds, paired with sync. A run
  that never reached sync's loss counts as infinitely slow in the medians (speedup 0)."""
  sync = {r["round"]: r for r in runs.get("sync", [])}
  out = {}
  for variant, recs in runs.items():
    to_target, ratios = [], []
    for r in recs:
      ref = sync.get(r["round"])
      if ref is None:
        continue
      target = ref["final_val_loss"]
      mine = straggler_lib.time_to_loss([[t, s, l] for t, s, l, _ in r["curve"]], target)
      base = straggler_lib.time_to_loss([[t, s, l] for t, s, l, _ in ref["curve"]], target)
      to_target.append(mine)
      if base:                 # a run that never reached the loss counts as infinitely slow
        ratios.append(0.0 if mine is None else base / mine)
    losses = [r["final_val_loss"] for r in recs]
    sync_losses = [sync[r["round"]]["final_val_loss"] for r in recs if r["round"] in sync]
    reached = [t for t in to_target if t is not None]
    out[variant] = {
        "samples_per_s": straggler_lib.median([r["samples_per_s"] for r in recs]),
        "samples_per_s_spread": straggler_lib.spread([r["samples_per_s"] for r in recs]),
        "final_val_loss": float(np.mean(losses)),
        "final_val_loss_std": float(np.std(losses)),
        "final_val_accuracy": float(np.mean([r["final_val_accuracy"] for r in recs])),
        "val_loss_vs_sync": (float(np.mean(losses) / np.mean(sync_losses) - 1)
                             if sync_losses else None),
        "time_to_sync_loss_s": _median_or_none(to_target),
        "reached": f"{len(reached)}/{len(to_target)}",
        "speedup_to_sync_loss": float(np.median(ratios)) if ratios else None,
        "updates": straggler_lib.median([r["updates"] for r in recs]),
    }
  return out


def _median_or_none(values) -> float | None:
  """The median with None (never reached) as infinity; None if that median is infinite."""
  if not values:
    return None
  m = float(np.median([np.inf if v is None else v for v in values]))
  return None if np.isinf(m) else m


def summarize(raw: dict) -> dict:
  return {model: {setting: summarize_cell(runs) for setting, runs in settings.items()}
          for model, settings in raw["runs"].items()}


def markdown(results: dict, title: str) -> str:
  lines = [f"### {title}", "",
           "| model | setting | variant | samples/s | final val loss (mean of seeds) | vs sync "
           "| val accuracy | time to sync's loss (s) | speedup to sync's loss | reached | "
           "updates |", "|" + "---|" * 11]
  for model, settings in results.items():
    for setting, cells in settings.items():
      for variant, r in cells.items():
        lines.append(
            f"| {model} | {setting} | {variant} | {report.fmt(r['samples_per_s'], '.0f')} "
            f"| {r['final_val_loss']:.4f} ± {r['final_val_loss_std']:.4f} "
            f"| {report.fmt(r['val_loss_vs_sync'], '+.2%')} | {r['final_val_accuracy']:.3f} "
            f"| {report.fmt(r['time_to_sync_loss_s'], '.1f')} "
            f"| {report.fmt(r['speedup_to_sync_loss'], '.2f')} | {r['reached']} "
            f"| {report.fmt(r['updates'], '.0f')} |")
  return "\n".join(lines) + "\n"


def targets(emulated: dict | None, real: dict | None) -> list[dict]:
  """The issue's targets, each marked met or not, with the figures behind it."""
  out = []
  for model, settings in (emulated or {}).items():
    cell = settings.get("4x1_slow2")
    if not cell or "ssaw" not in cell:
      continue
    s = cell["ssaw"]
    out.append({"target": f"{model} 4x1_slow2: ssaw reaches sync's loss >= 1.2x sooner",
                "value": s["speedup_to_sync_loss"],
                "met": s["speedup_to_sync_loss"] is not None and s["speedup_to_sync_loss"] >= 1.2})
    out.append({"target": f"{model} 4x1_slow2: ssaw's final loss within 0.5% of sync's",
                "value": s["val_loss_vs_sync"],
                "met": s["val_loss_vs_sync"] is not None and s["val_loss_vs_sync"] <= 0.005})
  ahead, total = [], 0
  for part in (emulated or {}, real or {}):
    for model, settings in part.items():
      for setting, cell in settings.items():
        if "ssaw" not in cell:
          continue
        for rival in ("async", "local_sgd"):
          if rival not in cell:
            continue
          total += 1
          mine, theirs = cell["ssaw"]["time_to_sync_loss_s"], cell[rival]["time_to_sync_loss_s"]
          if mine is not None and (theirs is None or mine < theirs):
            ahead.append(f"{model}/{setting} vs {rival}")
  out.append({"target": "ssaw ahead of async and local_sgd on time to sync's loss in most "
                        "settings", "value": f"{len(ahead)}/{total}",
              "met": total > 0 and len(ahead) > total / 2})
  return out


def plot(raw: dict, path: str, title: str) -> None:
  """Validation loss against training seconds, one panel per (model, setting), one line per
  variant (every seed, thin). Skipped when matplotlib is not installed."""
  plt = report.pyplot()
  if plt is None:
    return
  panels = [(m, s) for m, settings in raw["runs"].items() for s in settings]
  cols = 2
  rows = (len(panels) + cols - 1) // cols
  fig, axes = plt.subplots(rows, cols, figsize=(11, 3.2 * rows), squeeze=False)
  colors = dict(zip(VARIANTS, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  for ax, (model, setting) in zip(axes.reshape(-1), panels):
    for variant, recs in raw["runs"][model][setting].items():
      for i, r in enumerate(recs):
        c = np.asarray(r["curve"])
        if len(c):
          ax.plot(c[:, 0], c[:, 2], color=colors.get(variant), lw=1.0, alpha=0.8,
                  label=variant if i == 0 else None)
    ax.set_title(f"{model}, {setting}", fontsize=9)
    ax.set_xlabel("training seconds")
    ax.set_ylabel("validation loss")
  for ax in axes.reshape(-1)[len(panels):]:
    ax.axis("off")
  axes[0, 0].legend(fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
