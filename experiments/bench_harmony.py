r"""HarmonyTrain's benchmark: the planner's PatchPipe plan against Megatron-style even tensor and
data parallelism, an even pipeline and a compute-only planner, on 8 emulated devices in two
regions (four at speed 1, four at speed 0.5, links between the regions 100x slower).

  python experiments/bench_harmony.py --quick    # 16 steps per strategy, interleaved (~8 min)
  python experiments/bench_harmony.py            # 40 steps

Writes --out/{bench_harmony.json, bench_harmony.md, bench_harmony.png}: per strategy its plan,
median step time and spread, predicted step and the prediction's error, tokens/s, validation
loss against training seconds, time to the target loss, and the full plan's speedups
(`benchmarks/harmony.py` says how each is measured).
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

from benchmarks import harmony  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_harmony", "Output directory.")
_QUICK = flags.DEFINE_bool("quick", False, "16 steps per strategy instead of 40.")
_STEPS = flags.DEFINE_integer("steps", 0, "Steps per strategy (0: 16 quick, 40).")
_EVAL_EVERY = flags.DEFINE_integer("eval_every", 4, "Steps between validations (not timed).")


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(cli.quiet_libraries)
  if jax.device_count() < 8:
    raise app.UsageError(f"needs 8 devices, found {jax.device_count()} (XLA_FLAGS was set to "
                         "another count)")
  steps = _STEPS.value or (16 if _QUICK.value else 40)
  out = os.path.abspath(_OUT.value)
  with cli.one_line_errors():
    payload = harmony.run(out, steps, _EVAL_EVERY.value)
  print(harmony.table(payload))
  print(f"results in {out}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
