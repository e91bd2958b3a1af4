r"""Micro-benchmark: one transformer block on one device at every compiled bucket width.

A device that computes `w` of its C units must run GEMMs of width about w, not C. This times the
forward + backward of one block (attention + MLP) on a single device with every unit kind active
at each bucket width, in the single-width program (compiled for that width alone) and in the
branched program an uneven split runs, with each width kernel of `--kernels` ("switch" once per
branch mode of `--modes`, "pallas"); see benchmarks/widths.py. Every cell runs once per round,
in `--rounds` interleaved rounds; the results are rewritten after each round.

It reports the time relative to the single-width program at full capacity (ideally about w / C)
and the branched program's cost over the single-width one at the same width (the branched
step's overhead; the goal on a GPU is at most 1.03x), medians over rounds with their min-max.

  python experiments/bench_widths.py --out_dir=results/bench_widths
  python experiments/bench_widths.py --kernels=switch     # without the (slow on CPU) pallas
"""

import os
import sys

from absl import app, flags

# The repository root: benchmarks/ (benchmark and report code) lives beside the library.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import widths  # noqa: E402
from semijax.core import kernels  # noqa: E402
from semijax.core import precision as precision_lib  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_S = widths.Settings()
_OUT = flags.DEFINE_string("out_dir", "results/bench_widths", "Where to write the results.")
_D = flags.DEFINE_integer("d_model", _S.d_model, "Model width.")
_HEADS = flags.DEFINE_integer("heads", _S.heads, "Head capacity C (head_dim = d_model / heads).")
_FF = flags.DEFINE_integer("d_ff", _S.d_ff, "MLP unit capacity C.")
_SEQ = flags.DEFINE_integer("seq_len", _S.seq_len, "Sequence length.")
_BATCH = flags.DEFINE_integer("batch", _S.batch, "Batch size.")
_WIDTHS = flags.DEFINE_integer("num_widths", _S.num_widths, "Compiled bucket widths per kind.")
_REPEATS = flags.DEFINE_integer("repeats", _S.repeats,
                                "Timed calls per cell and round (their median is the figure).")
_ROUNDS = flags.DEFINE_integer("rounds", _S.rounds, "Interleaved rounds.")
_MODES = flags.DEFINE_list("modes", list(kernels.BRANCH_MODES), "Branch modes of switch to time.")
_KERNELS = flags.DEFINE_list("kernels", list(widths.KERNELS),
                             "Width kernels of the branched program (layout.kernel).")
_DTYPE = flags.DEFINE_enum("dtype", _S.dtype, list(precision_lib.DTYPES),
                           "Compute dtype of the block (weights stay float32).")


def main(argv):
  del argv
  with cli.one_line_errors():
    s = widths.Settings(
        d_model=_D.value, heads=_HEADS.value, d_ff=_FF.value, seq_len=_SEQ.value,
        batch=_BATCH.value, num_widths=_WIDTHS.value, repeats=_REPEATS.value,
        rounds=_ROUNDS.value, modes=tuple(_MODES.value), kernels=tuple(_KERNELS.value),
        dtype=_DTYPE.value).validate()
  payload = widths.run(s, out_dir=_OUT.value)
  print(f"{payload['device']} ({payload['backend']}), {payload['rounds_done']} rounds\n"
        f"{widths.table(payload)}")
  print(f"wrote {os.path.join(_OUT.value, 'bench_widths.json')} and bench_widths.md")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
