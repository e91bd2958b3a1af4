"""One transformer block on one device at every compiled bucket width: the single-width program
against the branched one an uneven split runs (experiments/bench_widths.py).

A device that computes w of its C units must run GEMMs of width about w, not C. Each cell is the
median milliseconds of `repeats` forward + backward passes of one block with every unit kind
active at one bucket width, in one of these programs:

  single    compiled for that width alone (what every device runs when all execute one width);
  branched  the program that serves every width (`layout.kernel`): "switch, <mode>", the
            `lax.switch` over every bucket width traced in branch mode <mode>
            (`core.kernels.BRANCH_MODES`), or "pallas", one program at capacity whose GEMMs
            skip the units past the width (`core.width_gemm`; on CPU Pallas's interpreter, so
            its time there says nothing about a GPU's).

The cells run in interleaved rounds (`benchmarks.rounds`); the ratios (single / full capacity,
branched / single at the same width) are taken round by round.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import jax
from flax import nnx

from benchmarks import blocks as blockbench
from benchmarks import mfu
from benchmarks import report
from benchmarks import rounds as rounds_lib
from semijax import errors
from semijax.core import kernels
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib
from semijax.core import precision as precision_lib
from semijax.models import layers

KERNELS = ("switch", "pallas")


@dataclasses.dataclass(frozen=True)
class Settings:
  """The block (global = local: one device) and how it is timed."""
  d_model: int = 256
  heads: int = 8            # head capacity C (head_dim = d_model / heads)
  d_ff: int = 1024          # MLP unit capacity C
  seq_len: int = 128
  batch: int = 8
  num_widths: int = 4       # compiled bucket widths per kind
  repeats: int = 10         # timed calls per cell and round (their median is the cell's figure)
  rounds: int = 3
  modes: tuple[str, ...] = kernels.BRANCH_MODES     # branch modes of switch
  kernels: tuple[str, ...] = KERNELS
  dtype: str = "float32"    # the block's compute dtype (weights float32)

  def validate(self) -> "Settings":
    """Itself, or `ConfigError` naming the flag."""
    bad = [m for m in self.modes if m not in kernels.BRANCH_MODES]
    if bad:
      raise errors.ConfigError(f"--modes: unknown {bad}; choose from {list(kernels.BRANCH_MODES)}")
    bad = [k for k in self.kernels if k not in KERNELS]
    if bad:
      raise errors.ConfigError(f"--kernels: unknown {bad}; choose from {list(KERNELS)}")
    for name in ("repeats", "rounds", "num_widths"):
      if getattr(self, name) < 1:
        raise errors.ConfigError(f"--{name}: must be at least 1, got {getattr(self, name)}")
    return self


def program_names(s: Settings) -> list[str]:
  """The branched programs: "switch, <mode>" per mode, and "pallas"."""
  return [f"{k}, {m}" if k == "switch" else k
          for k in s.kernels for m in (s.modes if k == "switch" else [None])]


def cells(s: Settings) -> tuple[list[tuple[int, int]], dict[str, Callable[[], float]]]:
  """([(mlp width, heads width)] of the buckets, {"<program>@<i>": ms of one round}): every
  program compiled and run once here, so the rounds time only runs."""
  mesh = mesh_lib.make_mesh(1, 1)
  block = layers.Block(s.d_model, s.heads, s.d_ff, causal=True,
                       precision=precision_lib.Precision(s.dtype), rngs=nnx.Rngs(0))
  lay = layout_lib.Layout.for_model(d_model=s.d_model, num_heads=s.heads, d_ff=s.d_ff,
                                    num_devices=1, num_widths=s.num_widths)
  x = jax.random.normal(jax.random.key(1), (s.batch, s.seq_len, s.d_model), s.dtype)
  at = mfu.bucket_layouts(lay)      # (mlp width, heads width, layout with those actives)

  def cell(fn, params, plan, mode=None):
    def call():   # a program keeps the branch mode of its first call (its trace)
      with kernels.branching(mode) if mode else contextlib.nullcontext():
        return fn(params, x, plan)
    jax.block_until_ready(call())
    return lambda: blockbench.median_ms(call, repeats=s.repeats)

  out = {}
  fn, params = blockbench.block_step(mesh, block, x)
  for i, (m, h, a) in enumerate(at):
    out[f"single@{i}"] = cell(fn, params, plan_lib.make_plan(a, mesh, widths={
        "mlp": (m,), "heads": (h,)}))
  for name in program_names(s):
    kernel, _, mode = name.partition(", ")
    fn, params = blockbench.block_step(mesh, block, x)     # a fresh jit per program
    for i, (*_, a) in enumerate(at):
      out[f"{name}@{i}"] = cell(fn, params, plan_lib.make_plan(a, mesh, kernel=kernel),
                                mode or None)
  return [(m, h) for m, h, _ in at], out


def payload(s: Settings, widths: list[tuple[int, int]], figures: dict[str, list[float]]) -> dict:
  """The JSON payload of the rounds in `figures` ({cell: [ms per round]})."""
  full = figures[f"single@{len(widths) - 1}"]
  results = []
  for i, (m, h) in enumerate(widths):
    single = figures[f"single@{i}"]
    results.append({
        "mlp_width": m, "heads_width": h, "work_fraction": m / s.d_ff,
        "single_ms": rounds_lib.stats(single),
        "relative_to_full": rounds_lib.ratio_stats(single, full),
        "branched_ms": {p: rounds_lib.stats(figures[f"{p}@{i}"]) for p in program_names(s)},
        "branched_over_single": {p: rounds_lib.ratio_stats(figures[f"{p}@{i}"], single)
                                 for p in program_names(s)}})
  return {"settings": dataclasses.asdict(s), "backend": jax.default_backend(),
          "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
          "rounds_done": min(len(v) for v in figures.values()), "widths": results}


def table(p: dict) -> str:
  """The markdown table of a payload: medians over rounds, (min-max) of the ratios."""
  s = p["settings"]
  names = list(p["widths"][0]["branched_ms"]) if p["widths"] else []
  rows = [[f"{r['mlp_width']}/{s['d_ff']}", f"{r['heads_width']}/{s['heads']}",
           r["work_fraction"], r["single_ms"]["median"], rounds_lib.cell(r["relative_to_full"])]
          + [f"{r['branched_ms'][n]['median']:.3g}, "
             f"{rounds_lib.cell(r['branched_over_single'][n], '.2f')}" for n in names]
          for r in p["widths"]]
  return report.markdown_table(
      ["mlp width", "heads width", "MLP work fraction", "single-width ms (fwd+bwd)",
       "single / full capacity (min-max)"] + [f"{n}: ms, x single (min-max)" for n in names], rows)


def run(s: Settings, out_dir: str | None = None) -> dict:
  """Compiles every cell, times `s.rounds` interleaved rounds and returns the payload; with
  `out_dir`, bench_widths.{json,md} are rewritten after every round."""
  widths, measures = cells(s)

  def write(figures):
    if out_dir:
      p = payload(s, widths, figures)
      report.write(out_dir, "bench_widths", p, table(p))
  return payload(s, widths, rounds_lib.interleave(measures, s.rounds, after_round=write))
