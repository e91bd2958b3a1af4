r"""Micro-benchmark: a resized device's block time at several keep ratios, in both resize modes.

ZERO-resizing only helps if a resized device really computes less. This times the forward +
backward of one transformer block (attention + MLP) on one device, resized to keep ratios 1.0,
0.75, 0.5 and 0.25 in `units` mode (both GEMMs of the block shrink) and in `contraction` mode
(the authors' variant: the contraction dimension of every GEMM shrinks; the attention scores and
softmax do not), relative to keep 1.0 and to the same block without resizing.

  python experiments/bench_resize.py --out_dir=results/bench_resize
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
from semijax.balance import priority as priority_lib  # noqa: E402
from semijax.balance import resize as resize_spec_lib  # noqa: E402
from semijax.core import layout as layout_lib  # noqa: E402
from semijax.core import mesh as mesh_lib  # noqa: E402
from semijax.core import plan as plan_lib  # noqa: E402
from semijax.core import resize as resize_lib  # noqa: E402
from semijax.models import layers  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "results/bench_resize", "Where to write the results.")
_D = flags.DEFINE_integer("d_model", 256, "Model width.")
_HEADS = flags.DEFINE_integer("heads", 8, "Heads (head_dim = d_model / heads).")
_FF = flags.DEFINE_integer("d_ff", 1024, "MLP hidden units.")
_SEQ = flags.DEFINE_integer("seq_len", 128, "Sequence length.")
_BATCH = flags.DEFINE_integer("batch", 8, "Batch size.")
_WIDTHS = flags.DEFINE_integer("num_widths", 4, "Compiled bucket widths per kind.")
_REPEATS = flags.DEFINE_integer("repeats", 20, "Timed calls per setting (median reported).")
KEEPS = (1.0, 0.75, 0.5, 0.25)


def main(argv):
  del argv
  mesh = mesh_lib.make_mesh(1, 1)
  block = layers.Block(_D.value, _HEADS.value, _FF.value, causal=True, rngs=nnx.Rngs(0))
  lay = layout_lib.Layout.for_model(d_model=_D.value, num_heads=_HEADS.value, d_ff=_FF.value,
                                    num_devices=1, num_widths=_WIDTHS.value)
  x = jax.random.normal(jax.random.key(1), (_BATCH.value, _SEQ.value, _D.value))
  fn, params = blockbench.block_step(mesh, block, x)
  median_ms = lambda plan: blockbench.median_ms(fn, params, x, plan, repeats=_REPEATS.value)
  exact_ms = median_ms(plan_lib.make_plan(lay, mesh))
  results, rows = [], []
  for mode in resize_lib.MODES:
    spec = resize_spec_lib.ResizeSpec(keep=(1.0,), mode=mode).validate(1)
    prio = priority_lib.Priority(
        spec, num_layers=1, d_model=_D.value, num_units={"mlp": _FF.value, "heads": _HEADS.value},
        unit_sizes={"mlp": 1, "heads": _D.value // _HEADS.value}, num_devices=1)
    by_keep = {}
    for keep in KEEPS:
      rz = prio.select(lay, (keep,))
      by_keep[keep] = median_ms(plan_lib.make_plan(lay, mesh, resize=rz))
      results.append({"mode": mode, "keep": keep, "ms": by_keep[keep],
                      "kept_mlp_units": int(rz.kept["mlp"][0, 0]),
                      "kept_heads": int(rz.kept["heads"][0, 0]),
                      "kept_features": int(rz.feats_kept["mlp"][0, 0]) if rz.feats else _D.value})
    for r in results[-len(KEEPS):]:
      r["relative_to_keep_1"] = r["ms"] / by_keep[1.0]
      r["relative_to_no_resize"] = r["ms"] / exact_ms
      rows.append([mode, r["keep"], r["ms"], r["relative_to_keep_1"],
                   r["relative_to_no_resize"]])
  rows.append(["no resizing", 1.0, exact_ms, float("nan"), 1.0])
  table = report.markdown_table(
      ["mode", "keep", "ms (fwd+bwd)", "time / keep 1.0", "time / no resizing"], rows)
  payload = {"config": {k: f.value for k, f in [
      ("d_model", _D), ("heads", _HEADS), ("d_ff", _FF), ("seq_len", _SEQ), ("batch", _BATCH),
      ("num_widths", _WIDTHS), ("repeats", _REPEATS)]},
             "backend": jax.default_backend(), "jax": jax.__version__, "results": results,
             "no_resize_ms": exact_ms}
  paths = report.write(_OUT.value, "bench_resize", payload, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
