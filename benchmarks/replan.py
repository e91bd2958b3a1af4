"""Re-planning a pipeline while it trains: `semi` against the even pipeline that keeps its
layout, on 8 emulated devices in two regions.

The setting is `configs/gpt_harmony.py` (an 8-layer GPT; stage 0 on four devices at speed 1,
stage 1 on four at 0.5; links between the regions 100x slower) at `device_gflops` 1.0 (a step
of about 2 s, most of it emulated). Two scenarios: `persistent`, those speeds throughout (a
layout made without knowing them), and `rotating`, the speeds shifted by one device id every
`rotate_every` steps, so that slow devices enter stage 0 and fast ones stage 1.

Cells, each a whole run through the training loop (`train.loop.train_and_evaluate`), in
interleaved rounds (`rounds.interleave`): per scenario `even` (the config's even pipeline,
kept) and `semi` (re-planning, `balance.replan`). A cell's figure is its training seconds (the
sum of its step times, moves included; warm-up and validation left out). Per round,
even / semi is the speedup.
Also, from the time model alone (no run): the oracle, which at every step runs the best layout
`balance.replan` finds for that step's speeds and moves for free, and the ideal, every device
busy at its speed with no bubble and free links (`harmony.ideal_step_s`); `semi`'s emulated
seconds (the time model's part of its steps) against the oracle's show what its decisions
leave, its measured seconds against its emulated ones what moves and this machine's real
compute add.

    python experiments/bench_replan.py      # 3 rounds of 4 runs of 60 steps (~27 min)
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from benchmarks import harmony
from benchmarks import report
from benchmarks import rounds as rounds_lib
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics
from semijax.train import pipeline_setup
from semijax.train import stage_balance

POLICIES = ("even", "semi")
SCENARIOS = ("persistent", "rotating")


@dataclasses.dataclass(frozen=True)
class Scenario:
  """The runs' length and the speeds' shifts (see module doc); `rotate_every` 0: persistent."""

  steps: int = 60
  rotate_every: int = 20
  device_gflops: float = 1.0

  def config(self, policy: str):
    c = config_lib.load(harmony.CONFIG)
    c.steps, c.eval_every, c.log_every, c.checkpoint_every = self.steps, self.steps, 10, 0
    c.hetero.device_gflops = self.device_gflops
    c.hetero.rotate_every = self.rotate_every
    c.balance.policy = policy
    return c


def scenarios(steps: int, rotate_every: int, device_gflops: float) -> dict:
  return {"persistent": Scenario(steps, 0, device_gflops),
          "rotating": Scenario(steps, rotate_every, device_gflops)}


def run_cell(scenario: Scenario, policy: str, cells: list) -> float:
  """Trains one run of `policy`; appends its summary and emulated seconds to `cells`; returns
  its training seconds."""
  workdir = tempfile.mkdtemp(prefix=f"replan_{policy}_")
  try:
    summary = train.train_and_evaluate(scenario.config(policy), workdir)
    records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  finally:
    shutil.rmtree(workdir, ignore_errors=True)
  seconds = float(sum(summary["step_times_s"]))
  emulated = [r["pipeline/emulated_s"] for r in records if "pipeline/emulated_s" in r]
  cells.append({"train_s": seconds, "replans": summary.get("replans", 0),
                "val_loss": summary["val/loss"],
                "logged_emulated_mean_s": float(np.mean(emulated))})
  return seconds


def model_seconds(scenario: Scenario) -> dict:
  """From the time model: the even layout's, the oracle's and the ideal's seconds over the run
  (every step at its own speeds), and the oracle's layouts."""
  run = config_lib.validate(scenario.config("semi"), 8)
  setup = pipeline_setup.build(run, pipeline_setup.resolve_plan(run, 8))
  balancer = stage_balance.StageBalancer(run, setup)
  planner, even = balancer.replanner, balancer.layout
  totals, best = {"even": 0.0, "oracle": 0.0}, {}
  for step in range(run.steps):
    speeds = balancer.speeds_at(step)
    key = tuple(speeds.tolist())
    if key not in best:
      best[key] = planner.best(speeds)
    totals["even"] += planner.seconds(even, speeds)
    totals["oracle"] += best[key][1]
  totals["ideal"] = harmony.ideal_step_s(run) * run.steps
  totals["oracle_layouts"] = [stage_balance.layout_text(layout) for layout, _ in best.values()]
  return totals


def table(figures: dict, cells: dict, models: dict, rounds: int) -> str:
  """The result table (see module doc), with its commit, date, machine and command."""
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  head = (f"commit {commit}, {time.strftime('%Y-%m-%d')}, {os.cpu_count()}-core machine, "
          f"command: `python experiments/bench_replan.py --rounds={rounds}`\n\n")
  rows = []
  for name, model in models.items():
    for policy in POLICIES:
      key = f"{name}/{policy}"
      if not figures.get(key):
        continue
      s = rounds_lib.stats(figures[key])
      speedup = rounds_lib.ratio_stats(figures[f"{name}/even"], figures[key])
      emulated = float(np.median([c["logged_emulated_mean_s"] for c in cells[key]]))
      replans = ",".join(map(str, sorted({c["replans"] for c in cells[key]})))
      rows.append([name, policy, f"{s['median']:.1f} ({s['min']:.1f}-{s['max']:.1f})",
                   f"{speedup['median']:.2f} ({speedup['min']:.2f}-{speedup['max']:.2f})",
                   f"{emulated:.3f}", replans, f"{cells[key][-1]['val_loss']:.4f}"])
    for bound in ("oracle", "ideal"):
      rows.append([name, f"{bound} (time model)", f"{model[bound]:.1f}",
                   f"{model['even'] / model[bound]:.2f}", "–", "–", "–"])
  return head + report.markdown_table(
      ["scenario", "cell", "training s, median (spread)", "speedup over even",
       "logged emulated s/step", "re-plans", "val_loss"], rows)


def run(out_dir: str, cases: dict, rounds: int, say=print) -> dict:
  """Every scenario's cells in `rounds` interleaved rounds; writes the JSON and table after
  each round and returns the payload."""
  models = {name: model_seconds(scenario) for name, scenario in cases.items()}
  cells = {f"{name}/{p}": [] for name in cases for p in POLICIES}
  measures = {key: (lambda key=key: run_cell(cases[key.split("/")[0]], key.split("/")[1],
                                             cells[key])) for key in cells}
  payload = {}

  def after_round(figures):
    payload.update(figures=figures, cells=cells, models=models,
                   scenarios={k: dataclasses.asdict(v) for k, v in cases.items()})
    paths = report.write(out_dir, "bench_replan", payload,
                         table(figures, cells, models, rounds))
    say(open(paths["md"]).read())

  rounds_lib.interleave(measures, rounds, after_round)
  return payload
