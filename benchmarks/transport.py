"""The collectives' transport threads at the process's priority or lowered: the step's time, A/B.

2 processes (one CPU device each, tensor = 2) pinned to cores 0 and 1 train the straggler
benchmark's model on the even split and on the 768/256 split (`breakdown.SPLITS`), without and
with a CPU-bound competitor on core 1. In each round every (split, nice) cell runs `steps` timed
steps, the order reversed every other round, the threads of gloo's event loop
(`semijax.core.transport`) set to that nice value before the cell: so drift of the machine hits
both settings alike. Per cell: step wall milliseconds, the loop threads' CPU milliseconds per step
on each process (/proc/self/task/<tid>/stat), and the host's steal share.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np

from benchmarks import breakdown
from benchmarks import report
from semijax.core import transport
from semijax.runtime import contention
from semijax.runtime import distributed
from semijax.runtime import hostcpu

SPLITS = ("even", "oracle")
LEVELS = (0, 19)


def thread_ticks(tasks: str = "/proc/self/task") -> dict[int, int]:
  """{thread id: user + system clock ticks} of every thread under `tasks` ({} without /proc)."""
  out = {}
  try:
    tids = [t for t in os.listdir(tasks) if t.isdigit()]
  except OSError:
    return out
  for t in tids:
    try:
      with open(os.path.join(tasks, t, "stat")) as f:
        fields = f.read().rsplit(")", 1)[1].split()   # the name may hold spaces and ")"
    except (OSError, IndexError):
      continue
    out[int(t)] = int(fields[11]) + int(fields[12])     # utime, stime (fields 14, 15)
  return out


def _cell_order(r: int, levels) -> list:
  cells = [(split, level) for split in SPLITS for level in levels]
  return cells if r % 2 == 0 else cells[::-1]


def run_worker(out: str, *, scenarios, rounds: int, steps: int, levels=LEVELS,
               core: int = 1) -> None:
  """One of the 2 processes (module doc); writes out/transport_process<i>.json:
  {scenario: {"even nice19": [{"round", "wall_ms", "loop_cpu_ms", "host_steal"}, ...]}}.

  Raises:
    PermissionError: a nice value could not be set back (lowering one needs root or
      RLIMIT_NICE), or no transport thread was found.
  """
  distributed.initialize()
  prepared = {split: breakdown.prepare(split) for split in SPLITS}
  loops = set(transport.transport_threads(samples=20))
  if not loops:
    raise PermissionError("no thread of the collectives' transport was found (Linux only)")
  tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
  results = {}
  for scenario in scenarios:
    injector = None
    if jax.process_index() == 0 and scenario != "none":
      injector = contention.Injector(core, "steady").start()
    try:
      for r in range(rounds):
        for split, level in _cell_order(r, levels):
          loops.update(transport.transport_threads(samples=3))
          got = transport.set_nice(sorted(loops), level)
          if any(v != level for v in got.values()):
            raise PermissionError(f"could not set the transport threads to nice {level} (got "
                                  f"{got}): lowering a nice value needs root or RLIMIT_NICE")
          p = prepared[split]
          for _ in range(2):                                 # settle at the new priority
            p.state, m = p.engine.train_step(p.state, p.batch, p.plan)
            float(m["loss"])
          meter, before, walls = hostcpu.StealMeter(), thread_ticks(), []
          for _ in range(steps):
            t = time.perf_counter()
            p.state, m = p.engine.train_step(p.state, p.batch, p.plan)
            float(m["loss"])
            walls.append(time.perf_counter() - t)
          after = thread_ticks()
          loop_ms = sum(after.get(t, 0) - before.get(t, 0) for t in loops) * tick_ms / steps
          results.setdefault(scenario, {}).setdefault(f"{split} nice{level}", []).append(
              {"round": r, "wall_ms": 1e3 * float(np.median(walls)), "loop_cpu_ms": loop_ms,
               "host_steal": meter.share()})
        print(f"[transport] {scenario} round {r}: done", flush=True)
    finally:
      if injector is not None:
        injector.stop()
  with open(os.path.join(out, f"transport_process{jax.process_index()}.json"), "w") as f:
    json.dump(results, f)


def summarize(per_process: list, levels=LEVELS) -> dict:
  """{scenario: {"cells": {cell: {...}}, "speedup": {split: {...}}, "even_over_oracle": {...}}}
  from each process's results. A cell: process 0's median step ms and its min / max, the loop
  threads' median CPU ms per step on each process, and the host's median and max steal. The
  speed-up of each split is nice 0's step time over the lowest-priority level's, of medians and
  paired (median of the per-round ratios); even_over_oracle is the uneven split's gain over the
  even one at each level."""
  base, low = f"nice{levels[0]}", f"nice{levels[-1]}"
  out = {}
  for scenario, cells in per_process[0].items():
    s = {"cells": {}, "speedup": {}, "even_over_oracle": {}}
    for cell, runs in cells.items():
      walls = [x["wall_ms"] for x in runs]
      steal = [x["host_steal"] for x in runs if x["host_steal"] is not None]
      s["cells"][cell] = {
          "wall_ms": float(np.median(walls)), "wall_ms_min": min(walls),
          "wall_ms_max": max(walls),
          "loop_cpu_ms": [float(np.median([x["loop_cpu_ms"] for x in p[scenario][cell]]))
                          for p in per_process],
          "host_steal": float(np.median(steal)) if steal else None,
          "host_steal_max": max(steal) if steal else None}
    for split in SPLITS:
      a, b = cells[f"{split} {base}"], cells[f"{split} {low}"]
      s["speedup"][split] = {
          "median": s["cells"][f"{split} {base}"]["wall_ms"] / s["cells"][f"{split} {low}"][
              "wall_ms"],
          "paired": float(np.median([x["wall_ms"] / y["wall_ms"] for x, y in zip(a, b)]))}
    for level in levels:
      e, o = cells[f"even nice{level}"], cells[f"oracle nice{level}"]
      s["even_over_oracle"][f"nice{level}"] = {
          "median": s["cells"][f"even nice{level}"]["wall_ms"]
          / s["cells"][f"oracle nice{level}"]["wall_ms"],
          "paired": float(np.median([x["wall_ms"] / y["wall_ms"] for x, y in zip(e, o)]))}
    out[scenario] = s
  return out


def markdown(summary: dict) -> str:
  """The cells as a table, then each split's speed-up and the uneven split's gain per level."""
  lines = ["| scenario | split | transport nice | step ms (median) | min-max | loop CPU ms/step "
           "(process 0 / 1) | host steal (median, max) |", "|" + "---|" * 7]
  for scenario, s in summary.items():
    for cell, c in s["cells"].items():
      split, level = cell.split(" nice")
      loop = " / ".join(f"{v:.1f}" for v in c["loop_cpu_ms"])
      lines.append(f"| {scenario} | {split} | {level} | {c['wall_ms']:.1f} | "
                   f"{c['wall_ms_min']:.0f}-{c['wall_ms_max']:.0f} | {loop} | "
                   f"{report.fmt(c['host_steal'], '.0%')}, "
                   f"{report.fmt(c['host_steal_max'], '.0%')} |")
  lines.append("")
  for scenario, s in summary.items():
    speed = ", ".join(f"{k} {v['median']:.2f}x (paired {v['paired']:.2f}x)"
                      for k, v in s["speedup"].items())
    gain = ", ".join(f"{k} {v['median']:.2f}x (paired {v['paired']:.2f}x)"
                     for k, v in s["even_over_oracle"].items())
    lines.append(f"- {scenario}: step time at nice 0 over the lowest priority: {speed}; the "
                 f"768/256 split's gain over the even split: {gain}")
  return "\n".join(lines) + "\n"
