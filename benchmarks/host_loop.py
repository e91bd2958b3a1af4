"""The training loop's host time per step, waiting for every step vs running ahead.

One cell is one in-process training run (`loop.train_and_evaluate`) of a config with
`run_ahead` False (the loop waits for each step and makes its batch in the loop) or True (steps
run ahead between records, batches made on a thread). Measured over the steps after warm-up:
the main thread's CPU seconds per step (the host's own time in the loop: dispatch, batches,
fetching metrics, bookkeeping; it sleeps while it waits, and XLA:CPU's device threads are not
counted) and the wall seconds per step. Cells run in interleaved rounds; the table gives each
mode's median with its spread (min-max over rounds) and the ratio ahead / wait per round.
"""

from __future__ import annotations

import tempfile
import time

import numpy as np

from benchmarks import report
from semijax.train import loop as train

MODES = {"wait": False, "ahead": True}


def run_cell(config, run_ahead: bool, engine_cache: dict) -> dict:
  """One run of `config` (`run_ahead` set) in a fresh workdir; its per-step figures."""
  config = config.copy_and_resolve_references()
  config.run_ahead = run_ahead
  marks = {}
  mark = lambda: marks.update(cpu=time.thread_time(), wall=time.perf_counter())
  with tempfile.TemporaryDirectory() as workdir:
    summary = train.train_and_evaluate(config, workdir, after_warmup=mark,
                                       engine_cache=engine_cache)
    cpu, wall = time.thread_time() - marks["cpu"], time.perf_counter() - marks["wall"]
  steps = len(summary["step_times_s"])
  return {"host_cpu_ms": 1e3 * cpu / steps, "wall_ms": 1e3 * wall / steps,
          "step_ms": 1e3 * float(np.sum(summary["step_times_s"])) / steps,
          "loss": summary["train/loss"]}


def measure(config, rounds: int) -> dict:
  """`rounds` interleaved rounds of both modes (one untimed run of each first: compiles)."""
  cache: dict = {}
  for ahead in MODES.values():
    run_cell(config, ahead, cache)
  cells = {m: [] for m in MODES}
  for r in range(rounds):
    for mode in (MODES if r % 2 == 0 else reversed(list(MODES))):
      cells[mode].append(run_cell(config, MODES[mode], cache))
  return cells


def summarize(cells: dict) -> dict:
  """Per mode and figure: median and (min, max) over rounds; per figure the median of the
  per-round ratios ahead / wait."""
  keys = ("host_cpu_ms", "wall_ms", "step_ms")
  out = {m: {k: {"median": float(np.median([c[k] for c in cs])),
                 "spread": [float(np.min([c[k] for c in cs])), float(np.max([c[k] for c in cs]))]}
             for k in keys} for m, cs in cells.items()}
  out["ahead_over_wait"] = {k: float(np.median([a[k] / w[k] for a, w in
                                                zip(cells["ahead"], cells["wait"])]))
                            for k in keys}
  out["same_loss"] = len({c["loss"] for cs in cells.values() for c in cs}) == 1
  return out


def markdown(summary: dict, header: str) -> str:
  rows = []
  for key, name in (("host_cpu_ms", "host CPU ms/step"), ("wall_ms", "wall ms/step (loop)"),
                    ("step_ms", "wall ms/step (steps)")):
    cell = lambda m: (f"{summary[m][key]['median']:.2f} "
                      f"({summary[m][key]['spread'][0]:.2f}-{summary[m][key]['spread'][1]:.2f})")
    rows.append([name, cell("wait"), cell("ahead"),
                 f"{summary['ahead_over_wait'][key]:.3f}"])
  return header + report.markdown_table(
      ["figure", "wait every step", "run ahead", "ahead / wait"], rows)
