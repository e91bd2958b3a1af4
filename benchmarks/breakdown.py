"""Where a training step's time goes, on each process: a profile of the compiled step, by part.

Each of 2 processes (one CPU device each, `tensor` = 2, pinned to its own core; optionally a
CPU-bound competitor on core 1) trains the straggler benchmark's model on a fixed split and
profiles a few steps with `jax.profiler`. XLA:CPU records every executed HLO instruction (its
thunk) with its duration; the compiled program's text gives each instruction's opcode and name
stack, which `category` sorts into the parts of a step:

  blocks       the split work: what a device computes of its units in every block (the ops under
               `core.tp.BLOCK_SCOPE`, forward and backward), the only part a split balances;
  repeated     what every device computes in full: embeddings, LayerNorms, residual adds, the
               output head and the loss (forward and backward outside the blocks);
  optimizer    the update after the gradients (AdamW, the gradient norm), on every parameter the
               device holds: its padded blocks and the replicated parameters;
  collectives  the all-reduces; their time includes waiting for the other process, so on a
               fast process it holds the imbalance;
  other        copies and anything without a name stack.

`unattributed` is the step's wall time less everything the device ran: host work between
steps (dispatch, reading the loss) and idle time. The splits: `even` (512/512 MLP units, the
single-width step), `oracle` (768/256, 3:1, the branched step over the two widths) and
`oracle_single` (the same split, every device executing width 768 in the single-width step:
the branched step's reference at the same largest width).
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import gzip
import json
import os
import re
import shutil
import time

import jax
import numpy as np

from benchmarks import report
from benchmarks import straggler
from semijax.core import kernels
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import tp
from semijax.runtime import contention
from semijax.runtime import distributed
from semijax.runtime import hostcpu
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import loop as train
from semijax.train import steps as steps_lib

PARTS = ("blocks", "repeated", "optimizer", "collectives", "other")
# {split: (MLP share of device 0, single width?)}: device 0 owns 3/4 in the uneven splits.
SPLITS = {"even": ((1, 1), True), "oracle": ((3, 1), False), "oracle_single": ((3, 1), True)}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
# Instructions that only run others (their own events would count their contents twice).
CONTAINERS = ("conditional", "while", "call", "tuple", "get-tuple-element", "parameter",
              "constant", "bitcast")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+) = ")


def instructions(hlo_text: str) -> dict:
  """{instruction name: (opcode, op_name)} of every instruction in an HLO module's text."""
  out = {}
  for line in hlo_text.splitlines():
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    rest = line[m.end():]
    if rest.startswith("("):            # a tuple type: skip to its matching parenthesis
      depth, i = 0, 0
      for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
          break
      rest = rest[i + 1:]
    else:
      rest = rest.split(" ", 1)[1] if " " in rest else ""
    opcode = rest.strip().split("(", 1)[0].strip()
    op_name = re.search(r'op_name="([^"]*)"', line)
    out[m.group(1)] = (opcode, op_name.group(1) if op_name else "")
  return out


def category(opcode: str, op_name: str) -> str | None:
  """The part of a step (`PARTS`) an instruction belongs to; None for a container."""
  if opcode in CONTAINERS:
    return None
  if any(opcode.startswith(c) for c in COLLECTIVES):
    return "collectives"
  if not op_name:
    return "other"
  if tp.BLOCK_SCOPE in op_name:
    return "blocks"
  if "jvp(" in op_name or "transpose(" in op_name:
    return "repeated"
  return "optimizer"


def op_times(trace_dir: str) -> dict:
  """{event name: total microseconds} of the complete events in the profile under
  `trace_dir` (the newest perfetto trace that `jax.profiler.trace` wrote)."""
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True), key=os.path.getmtime)
  with gzip.open(paths[-1], "rt") as f:
    trace = json.load(f)
  events = trace["traceEvents"] if isinstance(trace, dict) else trace
  out = collections.Counter()
  for e in events:
    if e.get("ph") == "X":
      out[e["name"]] += float(e.get("dur", 0.0))
  return dict(out)


def parts(times_us: dict, hlo: dict, steps: int) -> dict:
  """{part: milliseconds per step} of the profiled events that are instructions of `hlo`
  (`instructions`); the events of other programs and of the host are left out."""
  out = dict.fromkeys(PARTS, 0.0)
  for name, us in times_us.items():
    if name in hlo and (part := category(*hlo[name])) is not None:
      out[part] += us / 1e3 / steps
  return out


def top_ops(times_us: dict, hlo: dict, steps: int, per_part: int = 5) -> dict:
  """{part: [[milliseconds per step, instruction, opcode, name stack], ...]}: the `per_part`
  costliest instructions of each part."""
  rows = collections.defaultdict(list)
  for name, us in times_us.items():
    if name in hlo and (part := category(*hlo[name])) is not None:
      rows[part].append([round(us / 1e3 / steps, 3), name, *hlo[name]])
  return {p: sorted(r, reverse=True)[:per_part] for p, r in rows.items()}


def split_config(quick: bool, split: str):
  """The benchmark model's config with `split`'s layout (`SPLITS`)."""
  c = straggler.real_config(quick)
  ratio, _ = SPLITS[split]
  for kind, units in (("mlp", c.model.d_ff), ("heads", c.model.num_heads)):
    c.layout[kind] = tuple(layout_lib.proportional_counts(units, ratio))
  return c


def step_plan(engine, layout, single: bool):
  """The plan of a step of `layout`: single-width at its largest count, or branched over its
  own counts' widths."""
  if single:
    return engine.plan(layout, widths={k: (max(u.counts),) for k, u in layout.kinds().items()})
  own = layout_lib.Layout(**{k: u.replace(widths=tuple(sorted(set(u.counts))))
                             for k, u in layout.kinds().items()})
  return engine.plan(own)


@dataclasses.dataclass
class Prepared:
  """One split's step, compiled and run once on this process: what measuring it needs."""
  engine: object
  state: object
  batch: object
  plan: object
  layout: layout_lib.Layout


def prepare(split: str, quick: bool = False) -> Prepared:
  """The benchmark model on `split` (`SPLITS`), its step compiled and exercised; then, as the
  training loop after its warm-up, every process waits for the others and, on CPU, lowers the
  collectives' transport threads (`train.steps.start_together`)."""
  run = config_lib.validate(split_config(quick, split), jax.device_count(), jax.process_count())
  engine = train.build_engine(run)
  feed_index, feeds = mesh_lib.batch_feed(engine.mesh)
  batch = engine.shard_batch(data_lib.build(run.data, feed_index, feeds).train_batch(0))
  plan = step_plan(engine, run.layout, SPLITS[split][1])
  state = engine.init(run.seed, run.layout)
  engine.compile(state, batch, plan)
  engine.exercise(state, batch, plan)
  steps_lib.start_together(f"breakdown {split}")
  return Prepared(engine, state, batch, plan, run.layout)


def measure_split(p: Prepared, *, steps: int, profile_dir: str) -> dict:
  """This process's figures for one prepared split: wall and CPU seconds per step (median of
  `steps` timed steps), the host's steal share while they ran (`hostcpu`; None off Linux), and
  the profile of `steps` more by part."""
  engine, state, batch, plan = p.engine, p.state, p.batch, p.plan
  compiled = engine._compiled_fn("train", state, batch, plan)   # pylint: disable=protected-access
  hlo = instructions(compiled.as_text())
  walls, cpus = [], []
  for _ in range(3):                                 # warm: caches, first runs
    state, m = engine.train_step(state, batch, plan)
    float(m["loss"])
  meter = hostcpu.StealMeter()
  for _ in range(steps):
    t, c = time.perf_counter(), time.process_time()
    state, m = engine.train_step(state, batch, plan)
    float(m["loss"])
    walls.append(time.perf_counter() - t)
    cpus.append(time.process_time() - c)
  steal = meter.share()
  shutil.rmtree(profile_dir, ignore_errors=True)
  with jax.profiler.trace(profile_dir, create_perfetto_trace=True):
    t = time.perf_counter()
    for _ in range(steps):
      state, m = engine.train_step(state, batch, plan)
      float(m["loss"])
    profiled_s = (time.perf_counter() - t) / steps
  times = op_times(profile_dir)
  by_part = parts(times, hlo, steps)
  shutil.rmtree(profile_dir, ignore_errors=True)
  wall_ms = 1e3 * float(np.median(walls))
  return {"wall_ms": wall_ms, "cpu_ms": 1e3 * float(np.median(cpus)), "host_steal": steal,
          "profiled_wall_ms": 1e3 * profiled_s, "parts_ms": by_part,
          "unattributed_ms": max(0.0, 1e3 * profiled_s - sum(by_part.values())),
          "top_ops": top_ops(times, hlo, steps),
          "mlp_counts": list(p.layout.mlp.counts), "widths": dict(
              (k, list(w)) for k, w in plan.widths)}


def run_worker(out: str, *, quick: bool, scenarios, splits, steps: int, core: int = 1,
               branch_mode: str = "saved") -> None:
  """One of the 2 processes (see module doc), its branched steps traced in `branch_mode`
  (`core.kernels.BRANCH_MODES`); writes out/breakdown_process<i>.json."""
  distributed.initialize()
  with kernels.branching(branch_mode):
    results = _measure_all(out, quick=quick, scenarios=scenarios, splits=splits, steps=steps,
                           core=core)
  with open(os.path.join(out, f"breakdown_process{jax.process_index()}.json"), "w") as f:
    json.dump(results, f)


def _measure_all(out: str, *, quick: bool, scenarios, splits, steps: int, core: int) -> dict:
  results = {}
  for scenario in scenarios:
    results[scenario] = {}
    for split in splits:
      prepared = prepare(split, quick)
      injector = None
      if jax.process_index() == 0 and scenario != "none":
        injector = contention.Injector(core, "steady")
        injector.start()
      try:
        results[scenario][split] = measure_split(
            prepared, steps=steps, profile_dir=os.path.join(out, f"profile{jax.process_index()}"))
      finally:
        if injector is not None:
          injector.stop()
      print(f"[breakdown] {scenario} {split}: {results[scenario][split]}", flush=True)
  return results


def merge(per_process: list) -> dict:
  """{scenario: {split: {"process0": {...}, "process1": {...}}}} from each process's results."""
  out = {}
  for i, results in enumerate(per_process):
    for scenario, splits in results.items():
      for split, r in splits.items():
        out.setdefault(scenario, {}).setdefault(split, {})[f"process{i}"] = r
  return out


def branched_cost(merged: dict) -> dict:
  """{scenario: {"wall": ..., "cpu": ...}}: the oracle split's branched step over its
  single-width step at the same largest width (the branched step's overhead), in step wall time
  and in CPU time of process 0 (the device executing that width; CPU time does not count the
  time a loaded machine keeps the process waiting), where both were measured."""
  out = {}
  for scenario, splits in merged.items():
    if "oracle" in splits and "oracle_single" in splits:
      a, b = splits["oracle"]["process0"], splits["oracle_single"]["process0"]
      out[scenario] = {"wall": a["wall_ms"] / b["wall_ms"], "cpu": a["cpu_ms"] / b["cpu_ms"]}
  return out


def markdown(merged: dict) -> str:
  """One row per (scenario, split, process): milliseconds per step by part."""
  lines = ["| scenario | split (MLP units) | process | step wall ms | CPU ms | "
           + " | ".join(PARTS) + " | unattributed (host, idle) | host steal |",
           "|" + "---|" * (5 + len(PARTS) + 2)]
  for scenario, splits in merged.items():
    for split, procs in splits.items():
      for proc, r in sorted(procs.items()):
        counts = "/".join(str(c) for c in r["mlp_counts"])
        lines.append(f"| {scenario} | {split} ({counts}) | {proc[-1]} | {r['wall_ms']:.1f} "
                     f"| {r['cpu_ms']:.1f} | "
                     + " | ".join(f"{r['parts_ms'][p]:.1f}" for p in PARTS)
                     + f" | {r['unattributed_ms']:.1f} "
                     + f"| {report.fmt(r.get('host_steal'), '.0%')} |")
  return "\n".join(lines) + "\n"
