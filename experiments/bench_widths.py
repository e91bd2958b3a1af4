r"""Micro-benchmark: one transformer block on one device at every compiled bucket width.

A device that computes `w` of its C units must run GEMMs of width about w, not C. This times the
forward + backward of one block (attention + MLP) on a single device with every unit kind active
at each bucket width, in these programs:

  single    compiled for that width alone (what every device runs when all execute one width);
  branched  what an uneven split runs, which serves every width (`--kernels`, `layout.kernel`):
            "switch", the `lax.switch` over every bucket width with this width selected, once
            per branch mode (`core.kernels.BRANCH_MODES`: what a branch keeps for the backward
            pass); "pallas", one program at capacity whose GEMMs skip the units past this width
            (`core.width_gemm`; on CPU it runs in Pallas's interpreter, so its time there says
            nothing about a GPU's).

It reports the time relative to the single-width program at full capacity (ideally about w / C)
and the branched program's cost over the single-width one at the same width (the branched
step's overhead; the goal is at most 1.10x).

  python experiments/bench_widths.py --out_dir=results/bench_widths
  python experiments/bench_widths.py --kernels=switch     # without the (slow on CPU) pallas
"""

import contextlib

import os
import sys

from absl import app, flags
import jax
from flax import nnx

# The repository root: benchmarks/ (benchmark and report code) lives beside the library.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import blocks as blockbench  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.core import kernels  # noqa: E402
from semijax.core import layout as layout_lib  # noqa: E402
from semijax.core import mesh as mesh_lib  # noqa: E402
from semijax.core import plan as plan_lib  # noqa: E402
from semijax.core import precision as precision_lib  # noqa: E402
from semijax.models import layers  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "results/bench_widths", "Where to write the results.")
_D = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Head capacity C (head_dim = d_model / heads).")
_FF = flags.DEFINE_integer("d_ff", 1024, "MLP unit capacity C.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Sequence length.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_WIDTHS = flags.DEFINE_integer("num_widths", 4, "Compiled bucket widths per kind.")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed calls per program (median reported).")
_MODES = flags.DEFINE_list("modes", list(kernels.BRANCH_MODES), "Branch modes of switch to time.")
_KERNELS = flags.DEFINE_list("kernels", ["switch", "pallas"],
                             "Width kernels of the branched program (layout.kernel).")
_DTYPE = flags.DEFINE_enum("dtype", "float32", list(precision_lib.DTYPES),
                           "Compute dtype of the block (weights stay float32).")


def main(argv):
  del argv
  bad = [m for m in _MODES.value if m not in kernels.BRANCH_MODES]
  if bad:
    raise app.UsageError(f"--modes: unknown {bad}; choose from {list(kernels.BRANCH_MODES)}")
  bad = [k for k in _KERNELS.value if k not in ("switch", "pallas")]
  if bad:
    raise app.UsageError(f"--kernels: unknown {bad}; choose from ['switch', 'pallas']")
  mesh = mesh_lib.make_mesh(1, 1)
  block = layers.Block(_D.value, _HEADS.value, _FF.value, causal=True,
                       precision=precision_lib.Precision(_DTYPE.value), rngs=nnx.Rngs(0))
  lay = layout_lib.Layout.for_model(d_model=_D.value, num_heads=_HEADS.value, d_ff=_FF.value,
                                    num_devices=1, num_widths=_WIDTHS.value)
  x = jax.random.normal(jax.random.key(1), (_BATCH.value, _SEQ.value, _D.value), _DTYPE.value)
  median_ms = lambda *a: blockbench.median_ms(*a, repeats=_REPEATS.value)
  at = []      # (mlp width, heads width, layout with those actives)
  for i, w_mlp in enumerate(lay.mlp.widths):
    w_heads = lay.heads.widths[min(i, len(lay.heads.widths) - 1)]
    at.append((w_mlp, w_heads, lay.replace(mlp=lay.mlp.with_active([w_mlp]),
                                           heads=lay.heads.with_active([w_heads]))))
  fn, params = blockbench.block_step(mesh, block, x)
  single = [median_ms(fn, params, x, plan_lib.make_plan(a, mesh, widths={
      "mlp": (m,), "heads": (h,)})) for m, h, a in at]
  branched = {}        # {program name: ms at each width}
  for kernel in _KERNELS.value:
    for mode in (_MODES.value if kernel == "switch" else [None]):
      # a fresh jit per program: traced in its branch mode
      with kernels.branching(mode) if mode else contextlib.nullcontext():
        fn, params = blockbench.block_step(mesh, block, x)
        branched[f"{kernel}, {mode}" if mode else kernel] = [
            median_ms(fn, params, x, plan_lib.make_plan(a, mesh, kernel=kernel))
            for *_, a in at]
  full_ms = single[-1]
  results = [{"mlp_width": m, "heads_width": h, "work_fraction": m / _FF.value,
              "single_ms": single[i], "relative_to_full": single[i] / full_ms,
              "branched_ms": {mode: v[i] for mode, v in branched.items()},
              "branched_over_single": {mode: v[i] / single[i] for mode, v in branched.items()}}
             for i, (m, h, _) in enumerate(at)]
  rows = [[f"{r['mlp_width']}/{_FF.value}", f"{r['heads_width']}/{_HEADS.value}",
           r["work_fraction"], r["single_ms"], r["relative_to_full"]]
          + [f"{r['branched_ms'][m]:.3g} ({r['branched_over_single'][m]:.2f}x)"
             for m in branched] for r in results]
  table = report.markdown_table(
      ["mlp width", "heads width", "MLP work fraction", "single-width ms (fwd+bwd)",
       "single / full capacity"] + [f"{m}: ms (x single)" for m in branched], rows)
  payload = {"config": {k: f.value for k, f in [
      ("d_model", _D), ("heads", _HEADS), ("d_ff", _FF), ("seq_len", _SEQ), ("batch", _BATCH),
      ("repeats", _REPEATS), ("num_widths", _WIDTHS), ("dtype", _DTYPE), ("kernels", _KERNELS)]},
             "backend": jax.default_backend(),
             "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
             "widths": results, "plain_full_ms": full_ms}
  paths = report.write(_OUT.value, "bench_widths", payload, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
