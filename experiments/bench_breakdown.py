r"""Where a training step's time goes on each of 2 processes, with and without contention.

  python experiments/bench_breakdown.py --out=results/bench_breakdown      # about 3 minutes

2 processes joined by jax.distributed (one CPU device each, tensor = 2) pinned to cores 0 and 1
train the straggler benchmark's model on fixed splits (`benchmarks.breakdown.SPLITS`), with no
competitor (`none`) and a CPU-bound competitor on core 1 (`steady`), and profile the step: block
compute (the split work), the work every device repeats, the optimizer, the collectives, and
the rest (host, idle). Writes --out/breakdown.{json,md}.
"""

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import breakdown  # noqa: E402
from benchmarks import pair  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax import errors  # noqa: E402
from semijax.core import kernels  # noqa: E402
from semijax.core import transport  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_breakdown", "Output directory.")
_SCENARIOS = flags.DEFINE_list("scenarios", ["none", "steady"], "none and/or steady.")
_SPLITS = flags.DEFINE_list("splits", list(breakdown.SPLITS), "Splits to profile.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed (and as many profiled) steps per split.")
_MODE = flags.DEFINE_enum("branch_mode", "saved", list(kernels.BRANCH_MODES),
                          "What a branch of the branched step keeps for the backward pass.")
_NICE = flags.DEFINE_integer(
    "transport_nice", None, "Nice value of the collectives' transport threads (0 leaves them "
    "as they are; default: $SEMIJAX_TRANSPORT_NICE, else 19; see semijax.core.transport).")
_ROLE = flags.DEFINE_enum("role", "main", ["main", "worker"], "Internal.")


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  os.makedirs(out, exist_ok=True)
  bad = [s for s in _SCENARIOS.value if s not in ("none", "steady")]
  bad += [s for s in _SPLITS.value if s not in breakdown.SPLITS]
  if bad:
    raise app.UsageError(f"unknown scenarios or splits: {bad}")
  try:
    nice = transport.nice_value(_NICE.value)
  except errors.InputError as e:
    raise app.UsageError(f"--transport_nice: {e}") from None
  if _ROLE.value == "worker":
    breakdown.run_worker(out, quick=False, scenarios=_SCENARIOS.value, splits=_SPLITS.value,
                         steps=_STEPS.value, branch_mode=_MODE.value)
    return
  per_process = pair.run([sys.executable, os.path.abspath(__file__), "--role=worker",
                          f"--out={out}", f"--scenarios={','.join(_SCENARIOS.value)}",
                          f"--splits={','.join(_SPLITS.value)}", f"--steps={_STEPS.value}",
                          f"--branch_mode={_MODE.value}"], out, "breakdown", timeout_s=1800,
                         env={transport.ENV: str(nice)})
  merged = breakdown.merge(per_process)
  payload = {"steps": _STEPS.value, "branch_mode": _MODE.value, "transport_nice": nice,
             "results": merged,
             "branched_over_single": breakdown.branched_cost(merged)}
  table = breakdown.markdown(merged)
  paths = report.write(out, "breakdown", payload, table)
  print(table)
  print("branched / single-width step at the same largest width:",
        {k: {c: round(x, 3) for c, x in v.items()}
         for k, v in payload["branched_over_single"].items()})
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
