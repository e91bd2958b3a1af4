r"""The simulated study: every policy on 64 to 4,096 devices in every straggler scenario.

  python experiments/simulate.py                        # the full study (about 14 minutes here)
  python experiments/simulate.py --sizes=64,256 --steps=300 --scenarios=persistent,bursts
  python experiments/simulate.py --scenarios=replay --trace=trace.json --sizes=64  # its devices

Runs `semijax.sim.study` on the --hardware profile of --constants (default the nominal
H100-class cluster, `semijax/sim/profiles.py`; `cpu_2proc` is this machine's fitted one), then
measures the controller's own cost, the speed samples' bytes and the planner's own time at every
size (`semijax.sim.overhead`; the planner up to --planner_max devices). Writes
--out/{study.json, study.md, throughput.png}: the JSON of every run, the markdown tables
(throughput relative to `even`, `even` relative to the ideal, the overheads) and a plot of
throughput relative to the ideal against cluster size, one panel per scenario.
"""

import json
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report  # noqa: E402
from semijax import errors  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.sim import hardware  # noqa: E402
from semijax.sim import overhead  # noqa: E402
from semijax.sim import profiles  # noqa: E402
from semijax.sim import study  # noqa: E402
from semijax.sim import traces  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CONSTANTS = flags.DEFINE_string(
    "constants", os.path.join(ROOT, "benchmarks", "measurements", "sim_constants.json"),
    "The constants file (experiments/calibrate_sim.py writes it).")
_HARDWARE = flags.DEFINE_string("hardware", profiles.GPU, "The profile of --constants to use.")
_OUT = flags.DEFINE_string("out", "results/sim_study", "Output directory.")
_SIZES = flags.DEFINE_list("sizes", [str(s) for s in study.SIZES], "Cluster sizes (devices).")
_SCENARIOS = flags.DEFINE_list("scenarios", list(study.SCENARIOS), "Straggler scenarios.")
_POLICIES = flags.DEFINE_list("policies", list(study.POLICIES), "Policies (even included).")
_STEPS = flags.DEFINE_integer("steps", 1000, "Simulated steps per run.")
_SEED = flags.DEFINE_integer("seed", 0, "Traces and sample noise.")
_PIPE = flags.DEFINE_integer("pipe", study.PIPE, "Pipeline stages around the tensor groups "
                             "(1: tensor x data only, where semijax runs every policy today).")
_TRACE = flags.DEFINE_string("trace", "", "The trace file the `replay` scenario plays (JSON of "
                             "`semijax.sim.traces.Trace.to_json`: measured speeds over time); "
                             "--sizes must be its device count.")
_OVERHEAD = flags.DEFINE_bool("overhead", True, "Also measure the controller's own cost.")
_PLANNER_MAX = flags.DEFINE_integer("planner_max", max(study.SIZES), "Time the planner "
                                    "(semijax.planner) in the overhead table up to this many "
                                    "devices.")


def _check(values, allowed, name):
  bad = [v for v in values if v not in allowed]
  if bad:
    raise app.UsageError(f"--{name}: unknown {bad}; choose from {list(allowed)}")


def _scenario_params(sizes: list[int]) -> dict:
  """{"replay": {"path": --trace}} when the replay scenario runs, after checking the trace
  (readable, and one device count, that of --sizes); UsageError naming the flag."""
  if "replay" not in _SCENARIOS.value:
    if _TRACE.value:
      raise app.UsageError("--trace: only the replay scenario plays a trace; add it to "
                           "--scenarios")
    return {}
  if not _TRACE.value:
    raise app.UsageError("--trace: the replay scenario needs a trace file (JSON of "
                         "semijax.sim.traces.Trace.to_json)")
  try:
    with open(_TRACE.value) as f:
      trace = traces.Trace.from_json(json.load(f), field=f"--trace ({_TRACE.value})")
  except (OSError, ValueError) as e:     # unreadable, not JSON, or not a trace (ConfigError)
    raise app.UsageError(str(e) if isinstance(e, errors.InputError) else
                         f"--trace: cannot read {_TRACE.value!r}: {e}") from None
  if sizes != [trace.num_devices]:
    raise app.UsageError(f"--sizes: the replay trace has {trace.num_devices} devices; give "
                         f"--sizes={trace.num_devices}")
  return {"replay": {"path": _TRACE.value}}


def plot(result: dict, path: str) -> None:
  """Throughput relative to the ideal against cluster size, one panel per scenario."""
  plt = report.pyplot()
  if plt is None:
    return
  scenarios = result["scenarios"]
  cols = min(3, len(scenarios))
  rows = -(-len(scenarios) // cols)
  fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.2 * rows), squeeze=False)
  for ax, scenario in zip(axes.flat, scenarios):
    for policy in result["policies"]:
      cells = sorted((c["devices"], c["vs_ideal"]) for c in result["cells"]
                     if c["scenario"] == scenario and c["policy"] == policy)
      ax.plot([d for d, _ in cells], [v for _, v in cells], marker="o", ms=3, label=policy)
    ax.set_xscale("log", base=2)
    ax.set_title(scenario, fontsize=9)
    ax.set_xlabel("devices")
    ax.set_ylabel("throughput / ideal")
    ax.set_ylim(bottom=0)
  for ax in list(axes.flat)[len(scenarios):]:
    ax.axis("off")
  axes.flat[0].legend(fontsize=7)
  fig.suptitle(f"simulated, {result['hardware']['name']}: tensor {result['tensor']} x pipe "
               f"{result['pipe']} x data", fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  _check(_SCENARIOS.value, traces.SCENARIOS, "scenarios")
  _check(_POLICIES.value, study.POLICIES, "policies")
  if "even" not in _POLICIES.value:
    raise app.UsageError("--policies: must include 'even' (the reference)")
  try:
    sizes = [int(s) for s in _SIZES.value]
  except ValueError:
    raise app.UsageError(f"--sizes: integers, got {_SIZES.value}") from None
  params = _scenario_params(sizes)
  hw = hardware.load(_CONSTANTS.value).profile(_HARDWARE.value)
  t0 = time.perf_counter()
  say = lambda r: print(f"[sim] {r['devices']:5d} {r['scenario']:14s} {r['policy']:8s} "
                        f"vs even {r['vs_even']:.2f}  vs ideal {r['vs_ideal']:.2f}  "
                        f"{r['migrations']:3d} migrations  {r['wall_s']:.1f} s", flush=True)
  with cli.one_line_errors():
    result = study.run(hw, sizes=sizes, scenarios=_SCENARIOS.value, policies=_POLICIES.value,
                       steps=_STEPS.value, seed=_SEED.value, pipe=_PIPE.value, progress=say,
                       scenario_params=params)
  md = [f"# Simulated study ({hw.name}, tensor {study.TENSOR} x pipe {_PIPE.value} x data, "
        f"{_STEPS.value} steps per run)", "",
        "Throughput relative to `even` (`even` relative to the ideal: total work over total "
        "speed):", "", study.markdown(result)]
  if "planner" in _POLICIES.value:
    md += ["Layers per stage of the `planner` column (even: "
           f"{study.stage_layers(study.base_run(sizes[0], 'none', hw, 1, pipe=_PIPE.value))}):",
           "", study.layers_markdown(result)]
  if _OVERHEAD.value:
    rows = overhead.measure(hw, sizes=sizes, seed=_SEED.value, pipe=_PIPE.value,
                            planner_max=_PLANNER_MAX.value)
    result["overhead"] = rows
    md += ["The controller's own cost, the speed samples' bytes and the planner's own time:", "",
           overhead.markdown(rows)]
  timing = [c for c in result["cells"] if c["devices"] == 1024]
  if timing:
    slowest = max(timing, key=lambda c: c["wall_s"])
    md.append(f"A simulated run of 1,024 devices and {_STEPS.value} steps took "
              f"{min(c['wall_s'] for c in timing):.1f} to {slowest['wall_s']:.1f} s here "
              f"(slowest: {slowest['scenario']} / {slowest['policy']}).\n")
  result["seconds"] = time.perf_counter() - t0
  os.makedirs(_OUT.value, exist_ok=True)
  with open(os.path.join(_OUT.value, "study.json"), "w") as f:
    json.dump(result, f, indent=1)
  with open(os.path.join(_OUT.value, "study.md"), "w") as f:
    f.write("\n".join(md))
  plot(result, os.path.join(_OUT.value, "throughput.png"))
  print("\n".join(md))
  print(f"wrote {_OUT.value}/study.json, study.md, throughput.png "
        f"({result['seconds']:.0f} s)")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
