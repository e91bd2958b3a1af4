r"""The headline benchmark: every balancing policy under real contention and emulated stragglers.

  python experiments/bench_straggler.py --quick      # short runs, 3 rounds (about 20-25 minutes)
  python experiments/bench_straggler.py              # long runs, 3 rounds (about 50-95 minutes)
  python experiments/bench_straggler.py --quick --mode=real --scenarios=steady \
      --policies=even,static,semi                    # a part of it

Real contention: 2 processes joined by jax.distributed (one CPU device each, tensor = 2) pinned
to cores 0 and 1, and a competing CPU-bound process on core 1 (none / steady / bursts).
Emulated: one process, 8 fake devices, the authors' static profile and rotating straggler.
Every (scenario, policy) cell runs --rounds times in interleaved rounds (every policy once per
round, the order rotated; round r trains seed r). Writes --out/{results.json, results.md,
throughput.png, emulated.png}, the raw runs (real_raw.json, emulated_raw.json) and each run's
workdir (metrics, decisions.jsonl) under --out/runs/SCENARIO/POLICY/roundR.
"""

import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import straggler as sb  # noqa: E402
from semijax.core import transport  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.runtime import launch  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Short runs: 32 steps real, 8 emulated, 4 evaluations "
                           "each, a one-pass calibration (else 300 steps, 60 without "
                           "contention, 24 emulated, 8 evaluations).")
_OUT = flags.DEFINE_string("out", "results/bench_straggler", "Output directory.")
_MODE = flags.DEFINE_enum("mode", "all", ["all", "real", "emulated"], "Which part to run.")
_SCENARIOS = flags.DEFINE_list("scenarios", list(sb.SCENARIOS), "Real-contention scenarios.")
_EMULATED = flags.DEFINE_list("emulated", list(sb.EMULATED), "Emulated scenarios.")
_POLICIES = flags.DEFINE_list("policies", list(sb.POLICIES),
                              "Policies to compare; POLICY@MEASURE (semi@probe) with that "
                              "balance.measure.")
_ROUNDS = flags.DEFINE_integer("rounds", sb.ROUNDS, "Runs of every cell (interleaved rounds).",
                               lower_bound=1)
_ON = flags.DEFINE_float("on_s", None, "Bursts: seconds on (default 4 quick, 20 full).")
_OFF = flags.DEFINE_float("off_s", None, "Bursts: seconds off (default 4 quick, 20 full).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 7200, "Limit for each part.")
_CACHE, _CACHE_DIR = cli.define_cache_flags()
_ROLE = flags.DEFINE_enum("role", "main", ["main", "worker", "emulated"], "Internal.")


def _check(flag_values, allowed, name):
  bad = [v for v in flag_values if v not in allowed]
  if bad:
    raise app.UsageError(f"--{name}: unknown {bad}; choose from {list(allowed)}")


def main(argv):
  del argv
  out = os.path.abspath(_OUT.value)
  quick, rounds = _QUICK.value, _ROUNDS.value
  on_s = _ON.value or (4.0 if quick else 20.0)
  off_s = _OFF.value or (4.0 if quick else 20.0)
  mode = _MODE.value
  _check(_SCENARIOS.value, sb.SCENARIOS, "scenarios")
  _check(_EMULATED.value, sb.EMULATED, "emulated")
  _check(_POLICIES.value, sb.POLICIES + sb.MEASURED, "policies")
  if "even" not in _POLICIES.value or "static" not in _POLICIES.value:
    raise app.UsageError("--policies: must include 'even' and 'static' (the ratios' references)")
  with cli.one_line_errors():         # $SEMIJAX_TRANSPORT_NICE, checked before anything runs
    nice = transport.nice_value()
  os.makedirs(out, exist_ok=True)
  cli.apply_cache_flags(_CACHE, _CACHE_DIR)
  if _ROLE.value == "worker":
    sb.run_real_worker(out, quick=quick, scenarios=_SCENARIOS.value, policies=_POLICIES.value,
                       on_s=on_s, off_s=off_s, rounds=rounds)
    return
  if _ROLE.value == "emulated":
    sb.run_emulated(out, quick=quick, scenarios=_EMULATED.value, policies=_POLICIES.value,
                    rounds=rounds)
    return

  args = [f"--out={out}", f"--quick={quick}", f"--scenarios={','.join(_SCENARIOS.value)}",
          f"--emulated={','.join(_EMULATED.value)}", f"--policies={','.join(_POLICIES.value)}",
          f"--on_s={on_s}", f"--off_s={off_s}", f"--rounds={rounds}"]
  cache_args, cache = cli.cache_flags_for_children(_CACHE, _CACHE_DIR)   # the workers' cache
  args += cache_args
  if cache:
    print(f"[bench] compiled programs: {cache} (a rerun loads them)", flush=True)
  results = {"quick": quick, "rounds": rounds, "transport_nice": nice, "minutes": {},
             "compilation_cache": cache}
  if mode in ("all", "real"):
    if len(os.sched_getaffinity(0)) < 2:
      raise app.UsageError("the real-contention part needs 2 cores; use --mode=emulated")
    t0 = time.perf_counter()
    res = launch.launch([sys.executable, os.path.abspath(__file__), "--role=worker"] + args, 2,
                        cores=[[0], [1]], devices_per_process=1, timeout_s=_TIMEOUT.value,
                        log_dir=os.path.join(out, "logs"))
    if not res.ok:
      raise SystemExit(res.failure_message())
    results["minutes"]["real"] = round((time.perf_counter() - t0) / 60, 1)
    with open(os.path.join(out, "real_raw.json")) as f:
      raw = json.load(f)
    results["scenarios"] = sb.summarize(raw)
    results["noise"] = sb.noise(results["scenarios"])
    results["noise_spread_none"] = results["noise"].get("none")
    results["host_steal"] = sb.host_steal(results["scenarios"])
    results["speeds"] = raw["speeds"]
    results["bursts"] = raw["bursts"]
    results["orders"] = raw["orders"]
    sb.plot(raw, os.path.join(out, "throughput.png"),
            "gpt_tiny, 2 processes x 1 CPU device, competitor on core 1")
  if mode in ("all", "emulated"):
    t0 = time.perf_counter()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--role=emulated"] + args,
                   env=env, check=True, timeout=_TIMEOUT.value)
    results["minutes"]["emulated"] = round((time.perf_counter() - t0) / 60, 1)
    with open(os.path.join(out, "emulated_raw.json")) as f:
      raw = json.load(f)
    results["emulated"] = sb.summarize(raw)
    results["emulated_noise"] = sb.noise(results["emulated"])
    results["emulated_host_steal"] = sb.host_steal(results["emulated"])
    sb.plot(raw, os.path.join(out, "emulated.png"), "gpt_tiny, 8 fake devices, emulated slowdown")
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  md = [f"# bench_straggler{' (--quick)' if quick else ''}: {rounds} interleaved rounds, "
        f"{sum(results['minutes'].values()):.0f} minutes, collectives' transport threads at "
        f"nice {nice}", ""]
  if "scenarios" in results:
    md.append(sb.markdown(results["scenarios"], "Real contention (2 processes, tensor = 2)"))
    md.append(sb.noise_line(results["scenarios"]))
    md.append("")
  if "emulated" in results:
    md.append(sb.markdown(results["emulated"], "Emulated (8 fake devices)"))
    md.append(sb.noise_line(results["emulated"]))
    md.append("")
  md += ["### Targets (on medians)", ""] + sb.target_lines(results) + [""]
  text = "\n".join(md)
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
