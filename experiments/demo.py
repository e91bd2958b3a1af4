r"""Demo: one tensor device four times slower; even split, the speed-proportional split, and semi.

Trains `configs/gpt_tiny.py:cpu` (or --config, e.g. `configs/llama_tiny.py:cpu`) three times on
8 (fake) devices with the same seed and data and an emulated straggler (see benchmarks/demo.py):
`semi` starts from the even split and finds the straggler by itself. Writes demo.json, demo.md
and step_time.png.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/demo.py
  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/demo.py \
      --config=configs/llama_tiny.py:cpu --out_dir=results/demo_llama
"""

import os
import sys

from absl import app, flags
import jax

# The repository root: benchmarks/ (benchmark and report code) lives beside the library.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import demo  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "results/demo", "Where to write the table and plot.")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps per run.")
_SLOW = flags.DEFINE_integer("slow_device", 3, "Index of the slow tensor device.")
_FACTOR = flags.DEFINE_float("slowdown", 4.0, "How many times slower the slow device is.")
_CONFIG = flags.DEFINE_string("config", "configs/gpt_tiny.py:cpu", "The config file (and its "
                              "options after a colon) the three runs train.")
_CACHE, _CACHE_DIR = cli.define_cache_flags()


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  if jax.device_count() < demo.NUM_DEVICES:
    raise app.UsageError(
        f"the demo needs {demo.NUM_DEVICES} devices, found {jax.device_count()}; set "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={demo.NUM_DEVICES}")
  with cli.one_line_errors():
    cli.apply_cache_flags(_CACHE, _CACHE_DIR)   # a second demo loads its programs
    demo.main(_STEPS.value, _SLOW.value, _FACTOR.value, _OUT.value, _CONFIG.value)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
