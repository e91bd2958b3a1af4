"""The study: every policy on clusters of 64 to 4,096 devices, in every straggler scenario.

Clusters are tensor groups of 8 (one node each) in a pipeline of 4 stages, with data parallelism
around them (64 devices = 2 replicas, 4,096 = 128). The model is a GPT of about 6.7B parameters
(d_model 4096, 32 heads, d_ff 16384, 32 layers, 2,048 tokens per sequence, vocabulary 50,304),
16 sequences per replica per step in 8 microbatches. Every policy runs the same trace (same
seed) on simulated time; `static` is the oracle: the split of each stage proportional to the
mean speed its tensor positions had in the `even` run (the slowest replica at each position,
what one layout per stage can follow). `planner` is the oracle with uneven stages: the library's
planner (`semijax.planner`, through `sim.planning.stage_layers`) chooses each stage's layers for
the study's mesh and placement from every device's mean speed over the `even` run, and each
stage's split is the oracle's. The ideal is total work over total speed: each step's even,
single-width time at full speed over the cluster's mean device speed at that moment (the even
pipeline's work: a plan that takes layers off the stage with the head beats it).

The columns (`COLUMNS`) are the balancing policies under synchronous data parallelism, and
`semijax.sync`'s SSAW across the replicas with the even split (`ssaw`) and with `semi` inside
the stages (`semi+ssaw`).

`run` returns {"cells": [{devices, scenario, policy, tokens_per_s, vs_even, vs_ideal, ...}], ...};
`markdown` the table of throughput relative to `even` (and `even` relative to the ideal).
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from semijax.balance import settings as settings_lib
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware as hardware_lib
from semijax.sim import planning
from semijax.sim import simulator
from semijax.sim import stage as stage_lib
from semijax.sim import stepcost
from semijax.sim import strategies
from semijax.sim import traces as traces_lib
from semijax.sim import workload as workload_lib

SIZES = (64, 256, 1024, 4096)
SCENARIOS = ("none", "persistent", "bursts", "rotating", "fail_slow", "fail_slow_1pct",
             "slow_link")
# {column: (balancing policy, data-parallel strategy)}.
COLUMNS = {"even": ("even", "sync"), "static": ("static", "sync"),
           "planner": ("static", "sync"), "resize": ("resize", "sync"),
           "migrate": ("migrate", "sync"), "offload": ("offload", "sync"),
           "semi": ("semi", "sync"), "ssaw": ("even", "ssaw"), "semi+ssaw": ("semi", "ssaw")}
# The columns whose layers per stage the planner chooses (the others: as even as possible).
PLANNED = ("planner",)
POLICIES = tuple(COLUMNS)
TENSOR, PIPE = 8, 4


def workload() -> workload_lib.Workload:
  """The study's model and batch (see module doc)."""
  return workload_lib.Workload.gpt(d_model=4096, num_heads=32, d_ff=16384, num_layers=32,
                                   seq_len=2048, vocab_size=50304, batch_per_replica=16,
                                   microbatches=8)


def cluster(devices: int, scenario: str, pipe: int = PIPE) -> cluster_lib.Cluster:
  """tensor 8 x `pipe` x the rest; two regions for `slow_link` (its traffic must cross one)."""
  return cluster_lib.Cluster.of_size(devices, tensor=TENSOR, pipe=pipe,
                                     regions=2 if scenario == "slow_link" else 1)


def settings(policy: str) -> settings_lib.BalanceSettings:
  """The balance settings of every study run: the library's defaults, 8 compute widths in the
  big bucket (a 2,048-unit share needs finer steps than 4)."""
  return settings_lib.BalanceSettings(policy=policy, num_widths=8).validate(
      {p for p, _ in COLUMNS.values()})


def base_run(devices: int, scenario: str, hw: hardware_lib.Hardware, steps: int,
             seed: int = 0, pipe: int = PIPE) -> simulator.Run:
  return simulator.Run(workload(), cluster(devices, scenario, pipe), hw, settings("even"), steps,
                       seed=seed)


def trace_for(run: simulator.Run, scenario: str, params: dict | None = None,
              seed: int = 0) -> traces_lib.Trace:
  """The scenario's trace over twice the nominal length of the run, on the run's replicas of
  pipe x tensor devices."""
  c = run.cluster
  model = stepcost.StepModel(run.workload, c, run.hardware, strategies.make(run.strategy),
                             run.layers)
  duration = 2.0 * run.steps * simulator.nominal_step_s(model)
  return traces_lib.build(scenario, params, num_devices=c.devices, regions=c.regions,
                          duration_s=duration, seed=seed, replica_devices=c.pipe * c.tensor)


def oracle(run: simulator.Run, even: simulator.Result) -> tuple:
  """Per stage {kind: counts} proportional to the mean position speeds of the `even` run."""
  model = stepcost.StepModel(run.workload, run.cluster, run.hardware,
                             strategies.make(run.strategy), run.layers)
  return tuple(stage_lib.oracle_counts(stage_lib.stage_spec(run.workload.spec, layers), speeds)
               for layers, speeds in zip(model.layers, even.position_speeds))


def planned(run: simulator.Run, trace: traces_lib.Trace,
            even: simulator.Result) -> simulator.Run:
  """`run` with the planner's layers per stage for the devices' mean speeds in the `even` run
  (`even`, under `trace`)."""
  speeds = planning.mean_speeds(trace, even.step_s)
  return dataclasses.replace(run, layers=planning.stage_layers(run, speeds))


def column_run(base: simulator.Run, column: str, trace: traces_lib.Trace,
               even: simulator.Result) -> simulator.Run:
  """The run of `column` (`COLUMNS`): its layers, the oracle's split for `static`, strategy."""
  policy, strategy = COLUMNS[column]
  run = planned(base, trace, even) if column in PLANNED else base
  counts = oracle(run, even) if policy == "static" else None
  return dataclasses.replace(run.with_policy(policy, counts), strategy=strategy)


def stage_layers(run: simulator.Run) -> list[int]:
  """The layers per stage `run` simulates."""
  return list(stepcost.StepModel(run.workload, run.cluster, run.hardware,
                                 strategies.make(run.strategy), run.layers).layers)


def run_cell(devices: int, scenario: str, hw: hardware_lib.Hardware, steps: int,
             policies=POLICIES, seed: int = 0, params: dict | None = None,
             pipe: int = PIPE) -> list[dict]:
  """Every policy of one (cluster size, scenario): rows for `run`'s cells."""
  base = base_run(devices, scenario, hw, steps, seed, pipe)
  trace = trace_for(base, scenario, params, seed)
  runs = {"even": base}
  results = {"even": simulator.simulate(base, trace)}
  for column in policies:
    if column != "even":
      runs[column] = column_run(base, column, trace, results["even"])
      results[column] = simulator.simulate(runs[column], trace)
  even = results["even"]
  rows = []
  for column in policies:
    r = results[column]
    rows.append({"devices": devices, "scenario": scenario, **r.to_json(), "policy": column,
                 "strategy": COLUMNS[column][1], "stage_layers": stage_layers(runs[column]),
                 "vs_even": r.tokens_per_s / even.tokens_per_s,
                 "vs_ideal": r.tokens_per_s / even.ideal_tokens_per_s,
                 "decide_ms_per_step": 1e3 * r.stat("decide_s") / steps,
                 "slow_devices_mean": float(np.mean(trace_slow_share(trace, r)))})
  return rows


def trace_slow_share(trace: traces_lib.Trace, result: simulator.Result) -> list[float]:
  """Share of devices below speed 0.85 at each step start of `result`'s clock (for the table)."""
  trace.reset()
  out, clock = [], 0.0
  for step, s in enumerate(result.step_s):
    out.append(float(np.mean(trace.at(step, clock)[0] < 0.85)))
    clock += s
  trace.reset()
  return out


def run(hw: hardware_lib.Hardware, *, sizes=SIZES, scenarios=SCENARIOS, policies=POLICIES,
        steps: int = 1000, seed: int = 0, pipe: int = PIPE, progress=None,
        scenario_params: dict[str, dict] | None = None) -> dict:
  """The study (see module doc) of the `COLUMNS` named by `policies`; `progress(row)` after
  each cell's runs; `scenario_params`: {scenario: its parameters} (`traces.SCENARIOS`; e.g.
  {"replay": {"path": ...}})."""
  if "even" not in policies or set(policies) - set(COLUMNS):
    raise ValueError(f"sim.study.policies: {list(policies)} must include 'even' (the reference) "
                     f"and name columns of {list(COLUMNS)}")
  t0 = time.perf_counter()
  cells = []
  for devices in sizes:
    for scenario in scenarios:
      rows = run_cell(devices, scenario, hw, steps, policies, seed,
                      params=(scenario_params or {}).get(scenario), pipe=pipe)
      cells += rows
      if progress is not None:
        for r in rows:
          progress(r)
  return {"hardware": hw.to_json(), "workload": dataclasses.asdict(workload().spec)
          | {"vocab_size": workload().vocab_size, "batch_per_replica": 16, "microbatches": 8},
          "tensor": TENSOR, "pipe": pipe, "steps": steps, "seed": seed,
          "sizes": list(sizes), "scenarios": list(scenarios), "policies": list(policies),
          "strategies": list(strategies.REGISTRY), "pending": list(strategies.PENDING),
          "cells": cells, "seconds": time.perf_counter() - t0}


def markdown(study: dict) -> str:
  """Throughput relative to `even` per (scenario, devices), and `even` relative to the ideal."""
  policies = [p for p in study["policies"] if p != "even"]
  by = {(c["scenario"], c["devices"], c["policy"]): c for c in study["cells"]}
  head = ("| scenario | devices | even vs ideal | " + " | ".join(policies)
          + " | semi migrations | semi resized steps |")
  lines = [head, "|---" * (5 + len(policies)) + "|"]
  for scenario in study["scenarios"]:
    for devices in study["sizes"]:
      even = by[(scenario, devices, "even")]
      cells = [f"{by[(scenario, devices, p)]['vs_even']:.2f}" for p in policies]
      semi = by.get((scenario, devices, "semi"))
      lines.append(f"| {scenario} | {devices} | {even['vs_ideal']:.2f} | " + " | ".join(cells)
                   + f" | {semi['migrations'] if semi else '–'} "
                     f"| {semi['resized_steps'] if semi else '–'} |")
  return "\n".join(lines) + "\n"


def layers_markdown(study: dict, column: str = "planner") -> str:
  """The layers per stage `column` simulated, per scenario (rows) and cluster size (columns)."""
  by = {(c["scenario"], c["devices"]): c for c in study["cells"] if c["policy"] == column}
  lines = ["| scenario | " + " | ".join(str(d) for d in study["sizes"]) + " |",
           "|---" * (1 + len(study["sizes"])) + "|"]
  for scenario in study["scenarios"]:
    cells = [", ".join(str(x) for x in by[(scenario, d)]["stage_layers"]) if (scenario, d) in by
             else "–" for d in study["sizes"]]
    lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
  return "\n".join(lines) + "\n"
