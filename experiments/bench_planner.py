r"""The planner's benchmark: predicted steps of the planner and its baselines on 64 to 1,024
devices of 16 types in 4 regions, the planner's own time, and its hierarchical search against
the exact optimum on small clusters (`benchmarks/planner.py` says what is run).

  python experiments/bench_planner.py                  # about a minute here
  python experiments/bench_planner.py --sizes=1024 --quality_cases=0

Writes --out/{planner.json, planner.md}.
"""

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import planner  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_planner", "Output directory.")
_SIZES = flags.DEFINE_list("sizes", ["64", "256", "1024"], "Cluster sizes (devices).")
_TYPES = flags.DEFINE_integer("types", 16, "Device types.")
_REGIONS = flags.DEFINE_integer("regions", 4, "Regions.")
_BATCH = flags.DEFINE_integer("global_batch", 1024, "Sequences per step.")
_MICRO = flags.DEFINE_list("microbatch_sizes", ["1", "2", "4"], "Microbatch sizes to choose from.")
_REPEATS = flags.DEFINE_integer("repeats", 3, "Timed planner runs per size (median).")
_QUALITY = flags.DEFINE_integer("quality_cases", 20, "Small clusters for hierarchical vs exact.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  result = planner.run(tuple(int(s) for s in _SIZES.value), _TYPES.value, _REGIONS.value,
                       _BATCH.value, tuple(int(m) for m in _MICRO.value), _REPEATS.value,
                       _QUALITY.value)
  text = planner.table(result)
  paths = report.write(_OUT.value, "planner", result, text)
  print(text)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
