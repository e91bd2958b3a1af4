r"""Micro-benchmark: one transformer block on one device at every compiled bucket width.

A device that computes `w` of its C units must run GEMMs of width about w, not C. This times the
forward + backward of one block (attention + MLP) on a single device with every unit kind active
at each bucket width, and reports the time relative to full capacity (ideally about w / C), plus
the same block compiled without buckets (a plain full-width program) for the overhead of the
switch and the rematerialized branches.

  python experiments/bench_widths.py --out_dir=results/bench_widths
"""

import os
import sys

from absl import app, flags
import jax
from flax import nnx

# The repository root: benchmarks/ (benchmark and report code) lives beside the library.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import blocks as blockbench  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.core import layout as layout_lib  # noqa: E402
from semijax.core import mesh as mesh_lib  # noqa: E402
from semijax.core import plan as plan_lib  # noqa: E402
from semijax.models import layers  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "results/bench_widths", "Where to write the results.")
_D = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Head capacity C (head_dim = d_model / heads).")
_FF = flags.DEFINE_integer("d_ff", 1024, "MLP unit capacity C.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Sequence length.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_WIDTHS = flags.DEFINE_integer("num_widths", 4, "Compiled bucket widths per kind.")
_REPEATS = flags.DEFINE_integer("repeats", 30, "Timed calls per width (median reported).")


def main(argv):
  del argv
  mesh = mesh_lib.make_mesh(1, 1)
  block = layers.Block(_D.value, _HEADS.value, _FF.value, causal=True, rngs=nnx.Rngs(0))
  lay = layout_lib.Layout.for_model(d_model=_D.value, num_heads=_HEADS.value, d_ff=_FF.value,
                                    num_devices=1, num_widths=_WIDTHS.value)
  x = jax.random.normal(jax.random.key(1), (_BATCH.value, _SEQ.value, _D.value))
  fn, params = blockbench.block_step(mesh, block, x)
  median_ms = lambda *a: blockbench.median_ms(*a, repeats=_REPEATS.value)
  rows, results = [], []
  for i in range(len(lay.mlp.widths)):
    w_mlp = lay.mlp.widths[i]
    w_heads = lay.heads.widths[min(i, len(lay.heads.widths) - 1)]
    active = lay.replace(mlp=lay.mlp.with_active([w_mlp]), heads=lay.heads.with_active([w_heads]))
    ms = median_ms(fn, params, x, plan_lib.make_plan(active, mesh))
    results.append({"mlp_width": w_mlp, "heads_width": w_heads, "ms": ms,
                    "work_fraction": w_mlp / _FF.value})
  full_ms = results[-1]["ms"]
  plain = lay.replace(mlp=lay.mlp.replace(widths=(_FF.value,)),
                      heads=lay.heads.replace(widths=(_HEADS.value,)))
  plain_ms = median_ms(fn, params, x, plan_lib.make_plan(plain, mesh))
  for r in results:
    r["relative_to_full"] = r["ms"] / full_ms
    rows.append([f"{r['mlp_width']}/{_FF.value}", f"{r['heads_width']}/{_HEADS.value}",
                 r["work_fraction"], r["ms"], r["relative_to_full"]])
  rows.append(["plain (no buckets)", f"{_HEADS.value}/{_HEADS.value}", 1.0, plain_ms,
               plain_ms / full_ms])
  table = report.markdown_table(
      ["mlp width", "heads width", "MLP work fraction", "ms (fwd+bwd)", "time / full capacity"],
      rows)
  payload = {"config": {k: f.value for k, f in [
      ("d_model", _D), ("heads", _HEADS), ("d_ff", _FF), ("seq_len", _SEQ), ("batch", _BATCH),
      ("repeats", _REPEATS)]}, "backend": jax.default_backend(), "jax": jax.__version__,
             "widths": results, "plain_full_ms": plain_ms}
  paths = report.write(_OUT.value, "bench_widths", payload, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main)
