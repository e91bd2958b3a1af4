"""Model-FLOPs utilization of a training step on one device, at the compiled bucket widths.

A device that computes w of its units runs GEMMs of width w; its step does the model FLOPs of
those units (`step_flops`). MFU is those FLOPs per second over the device's peak for the step's
compute dtype (`peak_tflops`: the library's table of dense peaks, `semijax.core.flops`, or a
given number).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import jax
import numpy as np

from benchmarks import report
from benchmarks import rounds as rounds_lib
from semijax.core import flops

PEAK_TFLOPS, peak_tflops = flops.PEAK_TFLOPS, flops.peak_tflops     # the library's table


def step_flops(spec, widths: dict, tokens: int, vocab_size: int) -> float:
  """Model FLOPs of one training step (forward + backward = 3 x forward) of a GPT on one device.

  Args:
    spec: the model's `core.spec.ModelSpec`.
    widths: {kind: units the device computes in every block} ("mlp", "heads").
    tokens: tokens in the device's batch.
    vocab_size: the output head's width.
  """
  per_unit = spec.flops_per_unit()
  blocks = spec.num_layers * sum(per_unit[k] * w for k, w in widths.items())
  head = 2.0 * spec.d_model * vocab_size
  return 3.0 * tokens * (blocks + head)


def median_step_s(step, state, batch, plan, steps: int, warm: int = 3):
  """(median seconds of one step over `steps` timed steps after `warm` untimed ones, the final
  state); `step(state, batch, plan) -> (state, metrics)` donates its state."""
  m = None
  for _ in range(warm):
    state, m = step(state, batch, plan)
  jax.block_until_ready(m)
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    state, m = step(state, batch, plan)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t)
  return float(np.median(times)), state


def bucket_layouts(layout) -> list[tuple[int, int, object]]:
  """[(mlp width, heads width, `layout` with one device active at those widths)] for the i-th
  bucket width of each kind (the heads' last where they have fewer); `layout` of one device."""
  out = []
  for i, w_mlp in enumerate(layout.mlp.widths):
    w_heads = layout.heads.widths[min(i, len(layout.heads.widths) - 1)]
    out.append((w_mlp, w_heads, layout.replace(mlp=layout.mlp.with_active([w_mlp]),
                                               heads=layout.heads.with_active([w_heads]))))
  return out


def width_plans(engine, layout, kernels: Sequence[str]) -> list[tuple[dict, dict]]:
  """[({"mlp": w, "heads": h}, {program: plan})] at each bucket width: "single" (compiled for
  that width alone) and each width kernel of `kernels` (the branched step at that width)."""
  out = []
  for w_mlp, w_heads, at in bucket_layouts(layout):
    plans = {"single": engine.plan(at, widths={"mlp": (w_mlp,), "heads": (w_heads,)})}
    plans.update({k: dataclasses.replace(engine.plan(at), kernel=k) for k in kernels})
    out.append(({"mlp": w_mlp, "heads": w_heads}, plans))
  return out


def measure(engine, state, batch, layout, kernels: Sequence[str], steps: int, rounds: int,
            after_round: Callable[[list[dict], dict], None] | None = None):
  """(the widths' plans, {"<program>@<i>": [median seconds of `steps` steps, per round]}):
  `engine.train_step` at every bucket width and program of `width_plans`, each compiled and
  run once first, then timed in `rounds` interleaved rounds; `after_round(widths, figures)`
  after each round. The state (donated) runs through every cell."""
  widths = width_plans(engine, layout, kernels)
  holder = {"state": state}

  def cell(plan):
    def seconds(warm=1):
      s, holder["state"] = median_step_s(engine.train_step, holder["state"], batch, plan,
                                         steps, warm=warm)
      return s
    seconds(warm=3)          # compiles
    return seconds
  cells = {f"{name}@{i}": cell(plan) for i, (_, plans) in enumerate(widths)
           for name, plan in plans.items()}
  figures = rounds_lib.interleave(
      cells, rounds, after_round=None if after_round is None else
      lambda f: after_round(widths, f))
  return widths, figures


def results(widths, figures: dict, flops_of: Callable[[dict], float],
            peak: float | None) -> list[dict]:
  """Per bucket width: {"mlp_width", "heads_width", "model_flops", program: {"step_s" (median
  over rounds), "rounds" (`rounds.stats`), "tflops", "mfu" (None without a peak),
  "over_single" (per-round ratio's `rounds.stats`)}}."""
  out = []
  for i, (w, plans) in enumerate(widths):
    flops = flops_of(w)
    r = {"mlp_width": w["mlp"], "heads_width": w["heads"], "model_flops": flops}
    for name in plans:
      f = figures[f"{name}@{i}"]
      median = rounds_lib.stats(f)["median"]
      r[name] = {"step_s": median, "rounds": rounds_lib.stats(f),
                 "tflops": flops / median / 1e12,
                 "mfu": None if peak is None else flops / median / (peak * 1e12),
                 "over_single": rounds_lib.ratio_stats(f, figures[f"single@{i}"])}
    out.append(r)
  return out


def table(rows: list[dict], capacity: dict, kernels: Sequence[str]) -> str:
  """The markdown table of `results` (capacity: {"mlp": C, "heads": C})."""
  cells = [[f"{r['mlp_width']}/{capacity['mlp']}", f"{r['heads_width']}/{capacity['heads']}",
            1e3 * r["single"]["step_s"], r["single"]["tflops"],
            report.fmt(r["single"]["mfu"], ".1%")]
           + [f"{1e3 * r[k]['step_s']:.3g}, {rounds_lib.cell(r[k]['over_single'], '.2f')}, "
              f"{report.fmt(r[k]['mfu'], '.1%')}" for k in kernels] for r in rows]
  return report.markdown_table(
      ["mlp width", "heads width", "single ms", "single TFLOP/s", "single MFU"]
      + [f"branched, {k}: ms, x single (min-max), MFU" for k in kernels], cells)
