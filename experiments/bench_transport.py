r"""The step's time with the collectives' transport threads at the process's priority (nice 0)
or lowered (nice 19, what training does after its warm-up), in interleaved rounds.

  python experiments/bench_transport.py --out=results/bench_transport    # about 3 minutes

Needs 2 cores, Linux, and the right to lower a thread's nice value again (root, or
`ulimit -e 20`). See benchmarks/transport.py. Writes --out/transport.{json,md}.
"""

import os
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import pair  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks import transport as tb  # noqa: E402
from semijax import errors  # noqa: E402
from semijax.core import transport  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_transport", "Output directory.")
_SCENARIOS = flags.DEFINE_list("scenarios", ["none", "steady"], "none and/or steady.")
_ROUNDS = flags.DEFINE_integer("rounds", 6, "Interleaved rounds (each runs every cell once).",
                               lower_bound=1)
_STEPS = flags.DEFINE_integer("steps", 8, "Timed steps per cell and round.", lower_bound=1)
_LEVELS = flags.DEFINE_list("levels", ["0", "19"], "Nice values compared, the first the "
                            "reference (0: the process's priority).")
_ROLE = flags.DEFINE_enum("role", "main", ["main", "worker"], "Internal.")


def _levels() -> list[int]:
  try:
    levels = [transport.nice_value(int(v)) for v in _LEVELS.value]
  except (ValueError, errors.InputError) as e:
    raise app.UsageError(f"--levels: {_LEVELS.value} must be integers from 0 to 19 ({e})")
  if len(levels) < 2 or len(set(levels)) != len(levels):
    raise app.UsageError(f"--levels: need at least 2 different values, got {_LEVELS.value}")
  return levels


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  bad = [s for s in _SCENARIOS.value if s not in ("none", "steady")]
  if bad:
    raise app.UsageError(f"--scenarios: unknown {bad} (none, steady)")
  levels = _levels()
  if _ROLE.value == "worker":
    tb.run_worker(out, scenarios=_SCENARIOS.value, rounds=_ROUNDS.value, steps=_STEPS.value,
                  levels=levels)
    return
  if len(os.sched_getaffinity(0)) < 2:
    raise app.UsageError("needs 2 cores (one process on each)")
  os.makedirs(out, exist_ok=True)
  per_process = pair.run([sys.executable, os.path.abspath(__file__), "--role=worker",
                          f"--out={out}", f"--scenarios={','.join(_SCENARIOS.value)}",
                          f"--rounds={_ROUNDS.value}", f"--steps={_STEPS.value}",
                          f"--levels={','.join(map(str, levels))}"], out, "transport",
                         timeout_s=3600)
  summary = tb.summarize(per_process, levels)
  payload = {"rounds": _ROUNDS.value, "steps": _STEPS.value, "levels": levels,
             "summary": summary, "runs": per_process}
  table = tb.markdown(summary)
  paths = report.write(out, "transport", payload, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
