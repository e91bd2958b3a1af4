r"""Fits the simulator's constants to this machine's measured runs and checks them by replay.

  python experiments/calibrate_sim.py                 # refit from benchmarks/measurements/
  python experiments/calibrate_sim.py --results=results/bench_straggler \
      --migrate=results/bench_migrate/results.json    # take new measurements first

With --results (a `bench_straggler.py --quick --mode=all` output directory) and --migrate (a
`bench_migrate.py` results.json), it first copies what the fit needs into small JSON files in
--measurements (straggler_real.json, straggler_emulated.json, migrate.json). Then it fits the
profiles `cpu_2proc` and `cpu_8fake` (`semijax.sim.calibrate`), adds the nominal accelerator
profile (`semijax.sim.profiles`), replays every measured run with the fitted constants, with
its own recorded decisions (scripted: the costs) and with the library's current decision code
(decided), and writes --measurements/sim_constants.json (the profiles, the fitted contention
speed and every replay's errors) and --measurements/calibration.md (the error tables).
"""

import json
import os
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from semijax.runtime import cli  # noqa: E402
from semijax.sim import calibrate  # noqa: E402
from semijax.sim import hardware  # noqa: E402
from semijax.sim import profiles  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MEAS = flags.DEFINE_string("measurements", os.path.join(ROOT, "benchmarks", "measurements"),
                            "Where the measurement copies and the constants file live.")
_RESULTS = flags.DEFINE_string("results", None, "A bench_straggler output directory to copy.")
_MIGRATE = flags.DEFINE_string("migrate", None, "A bench_migrate results.json to copy.")

FILES = {"real": "straggler_real.json", "emulated": "straggler_emulated.json",
         "migrate": "migrate.json"}


def _write(path: str, payload: dict) -> None:
  with open(path, "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
    f.write("\n")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  out = _MEAS.value
  os.makedirs(out, exist_ok=True)
  if _RESULTS.value:
    _write(os.path.join(out, FILES["real"]), calibrate.extract_real(_RESULTS.value))
    _write(os.path.join(out, FILES["emulated"]), calibrate.extract_emulated(_RESULTS.value))
  if _MIGRATE.value:
    _write(os.path.join(out, FILES["migrate"]), calibrate.extract_migrate(_MIGRATE.value))
  measurements = calibrate.load_measurements(out)
  missing = sorted(set(FILES) - set(measurements))
  if missing:
    raise app.UsageError(f"--measurements={out}: no {', '.join(FILES[m] for m in missing)}; "
                         "pass --results and --migrate once")
  t0 = time.perf_counter()
  fitted, params = calibrate.fit(measurements)
  report, md = {}, ["# Calibration: replays of the measured runs with the fitted constants", ""]
  for name, hw in fitted.items():
    kind = "real" if name == calibrate.REAL else "emulated"
    report[name] = {"params": params[name], "measurements": FILES[kind]}
    for how, scripted in (("scripted", True), ("decided", False)):
      rows = calibrate.check(measurements[kind], hw, scripted=scripted,
                             **_replay_args(params[name]))
      worst = calibrate.worst(rows)
      report[name][how] = {"worst": worst, "rows": rows}
      md.append(calibrate.markdown(rows, f"{name} ({FILES[kind]}), {how}: " + (
          "the runs' own decisions" if scripted else "the current decision code decides")))
      noisy = (f" (runs left out as noisier than that: {', '.join(worst['noisy'])}: their steps "
               "before any change differ from the same steps of the scenario's even run by more "
               "than 10%)") if worst["noisy"] else ""
      md.append(f"Largest errors: step time {worst['step_error']:.1%}, ratio to even "
                f"{worst['vs_even_error']:.1%}, ratio to the oracle "
                f"{worst['vs_oracle_error']:.1%}{noisy}.\n")
  gpu = profiles.gpu_h100(fitted[calibrate.REAL].sample_noise)
  constants = hardware.Constants({**fitted, gpu.name: gpu},
                                 {"profiles": report, "fit_seconds": time.perf_counter() - t0})
  hardware.save(constants, os.path.join(out, "sim_constants.json"))
  with open(os.path.join(out, "calibration.md"), "w") as f:
    f.write("\n".join(md))
  print("\n".join(md))
  for name, hw in fitted.items():
    print(f"{name}: {json.dumps(hw.to_json())}")
  print(f"wrote {out}/sim_constants.json and calibration.md "
        f"({time.perf_counter() - t0:.0f} s)")


def _replay_args(params: dict) -> dict:
  return {"contention_speed": params["contention_speed"]} if "contention_speed" in params else {}


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
