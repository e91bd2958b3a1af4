r"""The headline benchmark: every balancing policy under real contention and emulated stragglers.

  python experiments/bench_straggler.py --quick          # real contention: 3 scenarios x 6 policies
  python experiments/bench_straggler.py --quick --mode=all   # ... plus the emulated part
  python experiments/bench_straggler.py                  # both parts, longer runs, 20 s bursts

Real contention: 2 processes joined by jax.distributed (one CPU device each, tensor = 2) pinned
to cores 0 and 1, and a competing CPU-bound process on core 1 (none / steady / bursts).
Emulated: one process, 8 fake devices, the authors' static profile and rotating straggler.
Writes --out/{results.json, results.md, throughput.png, emulated.png} and each run's workdir
(metrics, decisions.jsonl) under --out/runs.
"""

import json
import os
import subprocess
import sys

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import straggler as sb  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False,
                           "Short runs; the real-contention part only unless --mode.")
_OUT = flags.DEFINE_string("out", "results/bench_straggler", "Output directory.")
_MODE = flags.DEFINE_enum("mode", None, ["all", "real", "emulated"],
                          "Which part to run (default: real with --quick, else all).")
_SCENARIOS = flags.DEFINE_list("scenarios", list(sb.SCENARIOS), "Real-contention scenarios.")
_EMULATED = flags.DEFINE_list("emulated", list(sb.EMULATED), "Emulated scenarios.")
_POLICIES = flags.DEFINE_list("policies", list(sb.POLICIES), "Policies to compare.")
_ON = flags.DEFINE_float("on_s", None, "Bursts: seconds on (default 4 quick, 20 full).")
_OFF = flags.DEFINE_float("off_s", None, "Bursts: seconds off (default 4 quick, 20 full).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 3600, "Limit for each part.")
_ROLE = flags.DEFINE_enum("role", "main", ["main", "worker", "emulated"], "Internal.")

TARGETS = (("steady", "ratio_vs_even", 1.3), ("steady", "ratio_vs_oracle", 0.9),
           ("bursts", "ratio_vs_even", 1.15), ("none", "ratio_vs_even", 0.97))


def _check(flag_values, allowed, name):
  bad = [v for v in flag_values if v not in allowed]
  if bad:
    raise app.UsageError(f"--{name}: unknown {bad}; choose from {list(allowed)}")


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  quick = _QUICK.value
  on_s = _ON.value or (4.0 if quick else 20.0)
  off_s = _OFF.value or (4.0 if quick else 20.0)
  mode = _MODE.value or ("real" if quick else "all")
  _check(_SCENARIOS.value, sb.SCENARIOS, "scenarios")
  _check(_EMULATED.value, sb.EMULATED, "emulated")
  _check(_POLICIES.value, sb.POLICIES, "policies")
  if "even" not in _POLICIES.value or "static" not in _POLICIES.value:
    raise app.UsageError("--policies: must include 'even' and 'static' (the ratios' references)")
  os.makedirs(out, exist_ok=True)
  if _ROLE.value == "worker":
    sb.run_real_worker(out, quick=quick, scenarios=_SCENARIOS.value, policies=_POLICIES.value,
                       on_s=on_s, off_s=off_s)
    return
  if _ROLE.value == "emulated":
    sb.run_emulated(out, quick=quick, scenarios=_EMULATED.value, policies=_POLICIES.value)
    return

  args = [f"--out={out}", f"--quick={quick}", f"--scenarios={','.join(_SCENARIOS.value)}",
          f"--emulated={','.join(_EMULATED.value)}", f"--policies={','.join(_POLICIES.value)}",
          f"--on_s={on_s}", f"--off_s={off_s}"]
  results = {}
  if mode in ("all", "real"):
    from semijax.runtime import launch
    if len(os.sched_getaffinity(0)) < 2:
      raise app.UsageError("the real-contention part needs 2 cores; use --mode=emulated")
    res = launch.launch([sys.executable, os.path.abspath(__file__), "--role=worker"] + args, 2,
                        cores=[[0], [1]], devices_per_process=1, timeout_s=_TIMEOUT.value,
                        log_dir=os.path.join(out, "logs"))
    if not res.ok:
      raise SystemExit(res.failure_message())
    with open(os.path.join(out, "real_raw.json")) as f:
      raw = json.load(f)
    results["scenarios"] = sb.summarize(raw, ("none", "even"))
    results["noise_spread_none"] = sb.noise_spread(results["scenarios"])
    results["speeds"] = raw["speeds"]
    results["bursts"] = raw["bursts"]
    sb.plot(raw, os.path.join(out, "throughput.png"),
            "gpt_tiny, 2 processes x 1 CPU device, competitor on core 1")
  if mode in ("all", "emulated"):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--role=emulated"] + args,
                   env=env, check=True, timeout=_TIMEOUT.value)
    with open(os.path.join(out, "emulated_raw.json")) as f:
      raw = json.load(f)
    results["emulated"] = sb.summarize(raw, ("static_profile", "even"))
    sb.plot(raw, os.path.join(out, "emulated.png"), "gpt_tiny, 8 fake devices, emulated slowdown")
  results["quick"] = quick
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  md = ["# bench_straggler" + (" (--quick)" if quick else ""), ""]
  if "scenarios" in results:
    md.append(sb.markdown(results["scenarios"], "Real contention (2 processes, tensor = 2)"))
    semi = results["scenarios"]
    for scenario, key, target in TARGETS:
      if scenario in semi and "semi" in semi[scenario]:
        v = semi[scenario]["semi"][key]
        md.append(f"- {scenario}: semi {key} = {v:.2f} (target >= {target})")
    if results["noise_spread_none"] is not None:
      same = sb.same_split_runs(semi)
      md.append(f"- noise: in `none` the runs of {', '.join(same)} train the same even split; "
                f"their tokens/s spread by {results['noise_spread_none']:.0%} (max / min - 1)")
    md.append("")
  if "emulated" in results:
    md.append(sb.markdown(results["emulated"], "Emulated (8 fake devices); the baseline loss "
                          "is the static_profile / even run"))
  text = "\n".join(md)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main)
