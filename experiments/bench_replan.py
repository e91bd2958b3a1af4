r"""Re-planning a pipeline while it trains: `semi` against the even pipeline, with device speeds
that persist or shift every `--rotate_every` steps, on 8 emulated devices in two regions
(`configs/gpt_harmony.py`).

  python experiments/bench_replan.py      # 3 interleaved rounds of 4 runs of 60 steps (~27 min)

Writes --out/{bench_replan.json, bench_replan.md}: per scenario each policy's training seconds
(median and spread over rounds), its speedup over even (per round), its logged emulated step,
its re-plans and validation loss, and the time model's oracle and ideal
(`benchmarks/replan.py` says how each is measured).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from semijax.runtime import launch  # noqa: E402

# 8 fake CPU devices unless the caller chose a device count (read when the backend starts).
launch.default_device_count(8)

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
from absl import logging  # noqa: E402
import jax  # noqa: E402

from benchmarks import replan  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_replan", "Output directory.")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds of every policy.")
_STEPS = flags.DEFINE_integer("steps", 60, "Steps per run.")
_ROTATE = flags.DEFINE_integer("rotate_every", 20, "Steps between shifts of the speeds.")
_GFLOPS = flags.DEFINE_float("device_gflops", 1.0, "Emulated GFLOP/s of a device at speed 1.")


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(cli.quiet_libraries)
  if jax.device_count() < 8:
    raise app.UsageError(f"needs 8 devices, found {jax.device_count()} (XLA_FLAGS was set to "
                         "another count)")
  cases = replan.scenarios(_STEPS.value, _ROTATE.value, _GFLOPS.value)
  out = os.path.abspath(_OUT.value)
  with cli.one_line_errors():
    replan.run(out, cases, _ROUNDS.value)
  print(f"results in {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
