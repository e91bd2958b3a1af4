r"""The training loop's host time per step: waiting for every step vs running ahead.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/bench_loop.py \
      --out=results/bench_loop                                        # about 3 minutes on CPU

Trains configs/gpt_tiny.py:cpu (static policy, a record every --log_every steps) with
`run_ahead` False and True in interleaved rounds (`benchmarks.host_loop`); writes
--out/bench_loop.{json,md}.
"""

import datetime
import os
import platform
import subprocess
import sys

from absl import app, flags
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import host_loop  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.train import config as config_lib  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_loop", "Output directory.")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.", lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 100, "Training steps per run.", lower_bound=2)
_LOG = flags.DEFINE_integer("log_every", 25, "Steps between records.", lower_bound=1)
_TENSOR = flags.DEFINE_integer("tensor", 8, "Tensor devices.", lower_bound=1)


def make_config():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = config_lib.load(os.path.join(root, "configs", "gpt_tiny.py") + f":cpu,tensor={_TENSOR.value}")
  c.steps, c.log_every = _STEPS.value, _LOG.value
  c.eval_every, c.checkpoint_every = _STEPS.value, 0       # at the end only
  c.balance.policy = "static"
  return c


def main(argv):
  del argv
  cells = host_loop.measure(make_config(), _ROUNDS.value)
  summary = host_loop.summarize(cells)
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
  header = (f"commit {commit}, {datetime.date.today()}, {platform.machine()} "
            f"{os.cpu_count()} cores, {jax.device_count()} {jax.default_backend()} devices; "
            f"`python experiments/bench_loop.py --rounds={_ROUNDS.value} --steps={_STEPS.value} "
            f"--log_every={_LOG.value} --tensor={_TENSOR.value}`\n\n")
  table = host_loop.markdown(summary, header)
  paths = report.write(os.path.abspath(_OUT.value), "bench_loop",
                       {"cells": cells, "summary": summary}, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
