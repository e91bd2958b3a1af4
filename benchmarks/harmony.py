"""HarmonyTrain's benchmark: the planner's PatchPipe plan against three baselines, on 8 emulated
devices in two regions.

The scenario (`configs/gpt_harmony.py`): a GPT of 8 layers on 8 devices, four at speed 1 in
region 0 and four at speed 0.5 in region 1; links between the regions have 100x the latency and
1/100 the bandwidth of links inside one. Device time is emulated (`core.emulation.PipelineEmulator`,
`hetero.device_gflops` low enough that the emulated time, not this machine's real compute,
dominates a step); the real compute of the pipelined program runs on top of it.

Strategies (`semijax.planner.baselines`), each planned for the same model, batch and cluster:
  megatron       even tensor x data parallelism, no pipeline;
  even_pipeline  an even pipeline (equal layers per stage, even units and microbatches);
  compute_only   the planner blind to links (device speeds only), as Metis or HARP without
                 the network;
  full           the planner with links: PatchPipe.

All four train the same model from the same seed on the same batches with exact gradients, so
their losses agree step for step; they differ in time. Each strategy keeps its own engine and
state in this process, and the steps are interleaved: step k runs on every strategy, in an
order rotated with k, before step k + 1 runs on any, so the machine's noise falls on all alike.
Validation (not timed) runs every `eval_every` steps.

Results per strategy: the median step time with its spread (min-max over the timed steps, the
first left out), the predicted step (`planner.predict`) and the error of the prediction, tokens
per second, the validation loss against the training seconds, and the time to reach the target
loss (the highest final validation loss among the strategies, so every strategy reaches it).
Ratios of the full plan to each baseline (of medians, and the median of the per-step paired
ratios), and how far it is from the ideal: total work over total speed (every device busy, no
bubble, free links).
"""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from benchmarks import report
from benchmarks import straggler as straggler_lib
from semijax.planner import baselines
from semijax.train import config as config_lib
from semijax.train import pipeline_setup
from semijax.train import pipelined

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STRATEGIES = baselines.NAMES
BASELINES = tuple(s for s in STRATEGIES if s != "full")
CONFIG = os.path.join(ROOT, "configs", "gpt_harmony.py")   # the scenario: model, devices, links
TARGET_RATIO = 1.22          # the target: the full plan over the best baseline
PREDICTION_TOL = 0.10        # and its step within 10% of its prediction


def scenario_config(steps: int, eval_every: int):
  """The scenario's training config (`configs/gpt_harmony.py`) for `steps` steps."""
  c = config_lib.load(CONFIG)
  c.steps, c.eval_every = steps, eval_every
  c.plan = "auto"
  return c


def make_plans(run) -> dict:
  """{strategy: (its plan with the predicted step, the seconds planning took)}."""
  costs = pipeline_setup.model_costs(run)
  cluster = pipeline_setup.cluster(run, len(run.pipeline.devices.speeds))
  sizes = tuple(m for m in range(1, run.batch_size + 1) if run.batch_size % m == 0)
  out = {}
  for name in STRATEGIES:
    t0 = time.perf_counter()
    plan = baselines.BASELINES[name](costs, cluster, run.batch_size, sizes)
    out[name] = (plan, time.perf_counter() - t0)
  return out


def ideal_step_s(run) -> float:
  """Total work over total speed: every layer's forward, recomputed forward and backward (4x
  the forward, as `schedule.stage_seconds` counts it) of the whole batch, and the same of the
  embedding and head once, spread over all devices in proportion to their speed, with no
  bubble and free links."""
  costs = pipeline_setup.model_costs(run)
  tokens = run.batch_size * run.model.seq_len
  ms = costs.unit_ms(tokens)
  layers = costs.num_layers * sum(ms[k] * costs.num_units[k] for k in costs.kinds) * 1e-3
  work = 4 * (layers + float(costs.edge_s(tokens, 1)[0]))
  return work / float(np.sum(run.pipeline.devices.speeds))


def run(out_dir: str, steps: int, eval_every: int, say=print) -> dict:
  """Trains every strategy `steps` steps, interleaved; writes and returns the results."""
  config = scenario_config(steps, eval_every)
  run_cfg = config_lib.validate(config, jax.device_count())
  plans = make_plans(run_cfg)
  trainers, records = {}, {}
  for name in STRATEGIES:
    plan, seconds = plans[name]
    trainers[name] = pipelined.Pipelined(run_cfg, pipeline_setup.build(run_cfg, plan))
    trainers[name].init(run_cfg.seed)
    t0 = time.perf_counter()
    trainers[name].warm_up(0)
    warm = time.perf_counter() - t0
    records[name] = {"plan": plan.to_dict(), "planner_s": seconds, "warm_up_s": warm,
                     "predicted_s": plan.predicted_s,
                     "emulated_s": trainers[name].emulated["step_s"], "step_times_s": [],
                     "losses": [], "val": []}
    say(f"{name}: mesh data={plan.data} pipe={plan.pipe} tensor={plan.tensor}, layers "
        f"{list(plan.stage_layers)}, microbatches {list(plan.microbatches)} x "
        f"{plan.microbatch_size}, {plan.schedule}; predicted {plan.predicted_s:.3f} s/step "
        f"(planned in {seconds:.2f} s, compiled in {warm:.1f} s)")
  elapsed = {name: 0.0 for name in STRATEGIES}
  for step in range(steps):
    order = list(STRATEGIES[step % len(STRATEGIES):] + STRATEGIES[:step % len(STRATEGIES)])
    for name in order:
      result = trainers[name].step(step)
      elapsed[name] += result.seconds
      records[name]["step_times_s"].append(result.seconds)
      records[name]["losses"].append(result.metrics["loss"])
      if (step + 1) % eval_every == 0 or step + 1 == steps:
        val = trainers[name].evaluate()["val/loss"]
        records[name]["val"].append([step + 1, elapsed[name], val])
    say(f"step {step + 1}/{steps}: " + "  ".join(
        f"{n} {records[n]['step_times_s'][-1]:.2f} s" for n in STRATEGIES))
  payload = summarize(records, ideal_step_s(run_cfg), run_cfg)
  write(out_dir, payload)
  return payload


def time_to_target(val: list, target: float) -> tuple[int | None, float | None]:
  """(step, training seconds) of the first validation at or below `target`."""
  for step, seconds, loss in val:
    if loss <= target:
      return step, seconds
  return None, None


def summarize(records: dict, ideal_s: float, run_cfg) -> dict:
  """The results (see module doc) from the raw per-strategy records."""
  tokens = run_cfg.batch_size * run_cfg.model.seq_len
  target = max(r["val"][-1][2] for r in records.values())
  out = {"config": run_cfg.source, "target_val_loss": target, "ideal_step_s": ideal_s,
         "strategies": {}}
  for name, r in records.items():
    timed = r["step_times_s"][1:] or r["step_times_s"]
    med = straggler_lib.median(timed)
    step, seconds = time_to_target(r["val"], target)
    out["strategies"][name] = dict(
        r, median_step_s=med, step_spread_s=[float(np.min(timed)), float(np.max(timed))],
        tokens_per_s=tokens / med, prediction_error=med / r["predicted_s"] - 1,
        target_step=step, time_to_target_s=seconds, over_ideal=med / ideal_s)
  full = out["strategies"]["full"]
  for name in BASELINES:
    b = out["strategies"][name]
    paired = [x / y for x, y in zip(b["step_times_s"][1:], full["step_times_s"][1:])]
    b["full_speedup"] = b["median_step_s"] / full["median_step_s"]
    b["full_speedup_paired"] = straggler_lib.median(paired)
    b["full_time_to_target_speedup"] = (b["time_to_target_s"] / full["time_to_target_s"]
                                        if b["time_to_target_s"] and full["time_to_target_s"]
                                        else None)
  best = min(BASELINES, key=lambda n: out["strategies"][n]["median_step_s"])
  out["best_baseline"] = best
  out["full_over_best"] = out["strategies"][best]["full_speedup"]
  out["targets"] = {"full_over_best_at_least": TARGET_RATIO,
                    "prediction_error_within": PREDICTION_TOL,
                    "met": bool(out["full_over_best"] >= TARGET_RATIO
                                and abs(full["prediction_error"]) <= PREDICTION_TOL)}
  return out


def table(payload: dict) -> str:
  rows = []
  for name, s in payload["strategies"].items():
    p = s["plan"]
    rows.append([name, f"{p['data']}x{p['pipe']}x{p['tensor']}", str(p["stage_layers"]),
                 str(p["microbatches"]), s["median_step_s"],
                 f"{s['step_spread_s'][0]:.3g}-{s['step_spread_s'][1]:.3g}", s["predicted_s"],
                 f"{100 * s['prediction_error']:+.1f}%", s["tokens_per_s"],
                 s["time_to_target_s"] if s["time_to_target_s"] is not None else "never",
                 s.get("full_speedup", 1.0), s.get("full_speedup_paired", 1.0),
                 s["over_ideal"]])
  header = ["strategy", "data x pipe x tensor", "layers/stage", "microbatches", "median step s",
            "spread s", "predicted s", "error", "tokens/s", "s to target loss",
            "full's speedup", "paired", "x ideal"]
  t = payload["targets"]
  error = payload["strategies"]["full"]["prediction_error"]
  note = (f"\nTarget validation loss {payload['target_val_loss']:.4f}; ideal step (total work / "
          f"total speed) {payload['ideal_step_s']:.3f} s. Full plan over the best baseline "
          f"({payload['best_baseline']}): {payload['full_over_best']:.3f}x (target >= "
          f"{t['full_over_best_at_least']}x); its step {100 * error:+.1f}% "
          f"from its prediction (target within {100 * t['prediction_error_within']:.0f}%): "
          f"{'met' if t['met'] else 'NOT met'}.\n")
  return report.markdown_table(header, rows) + note


def plot(out_dir: str, payload: dict) -> str | None:
  plt = report.pyplot()
  if plt is None:
    return None
  fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
  for name, s in payload["strategies"].items():
    val = np.asarray(s["val"])
    a.plot(val[:, 1], val[:, 2], marker="o", label=name)
  a.axhline(payload["target_val_loss"], color="gray", ls=":", label="target")
  a.set_xlabel("training seconds")
  a.set_ylabel("validation loss")
  a.legend()
  names = list(payload["strategies"])
  x = np.arange(len(names))
  b.bar(x - 0.2, [payload["strategies"][n]["median_step_s"] for n in names], 0.4,
        label="measured (median)")
  b.bar(x + 0.2, [payload["strategies"][n]["predicted_s"] for n in names], 0.4,
        label="predicted")
  b.axhline(payload["ideal_step_s"], color="gray", ls=":", label="ideal")
  b.set_xticks(x, names)
  b.set_ylabel("seconds per step")
  b.legend()
  fig.tight_layout()
  path = os.path.join(out_dir, "bench_harmony.png")
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def write(out_dir: str, payload: dict) -> dict:
  paths = report.write(out_dir, "bench_harmony", payload, table(payload))
  png = plot(out_dir, payload)
  if png:
    paths["png"] = png
  return paths
