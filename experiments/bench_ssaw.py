r"""The SSAW study: sync, ssaw, async and local_sgd with replicas of unequal speed.

  python experiments/bench_ssaw.py --quick     # both parts, short runs (about 12 minutes)
  python experiments/bench_ssaw.py             # longer runs, every emulated setting

Trains gpt_tiny and vit_digits (their `:cpu` variants) with
  * real contention: 2 processes joined by jax.distributed, one replica (one CPU device) each,
    pinned to cores 0 and 1; a CPU-bound competitor on core 1, steady or in bursts;
  * emulated replicas: one process, 8 fake devices, 4 or 8 replicas with one or two 2x / 4x
    slower (`benchmarks/ssaw.py` EMULATED);
3 seeds per cell in interleaved rounds, every variant (sync, ssaw, ssaw with the alternative
weighting, async, local_sgd). Writes --out/{results.json, results.md, real.png, emulated.png}
(validation loss against training seconds) and every run's workdir under --out/runs.
"""

import json
import os
import subprocess
import sys
import time

from absl import app
from absl import flags
from absl import logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import ssaw as sb  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.runtime import launch  # noqa: E402

_QUICK = flags.DEFINE_bool("quick", False, "Short runs, two emulated settings.")
_OUT = flags.DEFINE_string("out", "results/bench_ssaw", "Output directory.")
_MODE = flags.DEFINE_enum("mode", "all", ["all", "real", "emulated"], "Which part to run.")
_MODELS = flags.DEFINE_list("models", list(sb.MODELS), "Models.")
_SCENARIOS = flags.DEFINE_list("scenarios", list(sb.REAL), "Real-contention scenarios.")
_EMULATED = flags.DEFINE_list("emulated", None, "Emulated settings (default: quick's two, or "
                              "all).")
_VARIANTS = flags.DEFINE_list("variants", list(sb.VARIANTS), "Sync variants.")
_ROUNDS = flags.DEFINE_integer("rounds", sb.ROUNDS, "Seeds (interleaved rounds) per cell.")
_ON = flags.DEFINE_float("on_s", None, "Bursts: seconds on (default 2 quick, 10 full).")
_OFF = flags.DEFINE_float("off_s", None, "Bursts: seconds off (default 2 quick, 10 full).")
_TIMEOUT = flags.DEFINE_integer("timeout_s", 5400, "Limit for each part.")
_FROM_RAW = flags.DEFINE_bool("from_raw", False, "Run nothing: summarize --out's raw JSON files "
                               "again (after a change to the summary).")
_CACHE, _CACHE_DIR = cli.define_cache_flags()
_ROLE = flags.DEFINE_enum("role", "main", ["main", "worker", "emulated"], "Internal.")


def _check(values, allowed, name):
  bad = [v for v in values if v not in allowed]
  if bad:
    raise app.UsageError(f"--{name}: unknown {bad}; choose from {list(allowed)}")


def main(argv):
  del argv
  logging.get_absl_handler().addFilter(cli.quiet_libraries)   # no Orbax INFO per checkpoint
  out = os.path.abspath(_OUT.value)
  quick = _QUICK.value
  on_s = _ON.value or (2.0 if quick else 10.0)
  off_s = _OFF.value or (2.0 if quick else 10.0)
  emulated = _EMULATED.value or list(sb.QUICK_EMULATED if quick else sb.EMULATED)
  _check(_MODELS.value, sb.MODELS, "models")
  _check(_SCENARIOS.value, sb.REAL, "scenarios")
  _check(emulated, sb.EMULATED, "emulated")
  _check(_VARIANTS.value, sb.VARIANTS, "variants")
  if "sync" not in _VARIANTS.value:
    raise app.UsageError("--variants: must include 'sync' (the reference of every figure)")
  os.makedirs(out, exist_ok=True)
  cli.apply_cache_flags(_CACHE, _CACHE_DIR)
  common = dict(quick=quick, models=_MODELS.value, variants=_VARIANTS.value,
                rounds=_ROUNDS.value)
  if _ROLE.value == "worker":
    sb.run_real_worker(out, scenarios=_SCENARIOS.value, on_s=on_s, off_s=off_s, **common)
    return
  if _ROLE.value == "emulated":
    sb.run_emulated(out, settings=emulated, **common)
    return

  args = [f"--out={out}", f"--quick={quick}", f"--models={','.join(_MODELS.value)}",
          f"--scenarios={','.join(_SCENARIOS.value)}", f"--emulated={','.join(emulated)}",
          f"--variants={','.join(_VARIANTS.value)}", f"--rounds={_ROUNDS.value}",
          f"--on_s={on_s}", f"--off_s={off_s}"]
  cache_args, cache = cli.cache_flags_for_children(_CACHE, _CACHE_DIR)   # both parts' cache
  args += cache_args
  if cache:
    print(f"[bench] compiled programs: {cache} (a rerun loads them)", flush=True)
  me = os.path.abspath(__file__)
  results, seconds = {"quick": quick, "compilation_cache": cache}, {}
  if _MODE.value in ("all", "real") and not _FROM_RAW.value:
    if len(launch.machine_cores()) < 2:
      raise app.UsageError("the real-contention part needs 2 cores; use --mode=emulated")
    t0 = time.perf_counter()
    res = launch.launch([sys.executable, me, "--role=worker"] + args, 2, cores=[[0], [1]],
                        devices_per_process=1, timeout_s=_TIMEOUT.value,
                        log_dir=os.path.join(out, "logs"))
    if not res.ok:
      raise SystemExit(res.failure_message())
    seconds["real"] = time.perf_counter() - t0
  real_raw, emulated_raw = (os.path.join(out, f"{p}_raw.json") for p in ("real", "emulated"))
  if _MODE.value in ("all", "real") and os.path.exists(real_raw):
    with open(real_raw) as f:
      raw = json.load(f)
    results["real"] = sb.summarize(raw)
    results["bursts"] = raw["bursts"]
    sb.plot(raw, os.path.join(out, "real.png"), "2 processes x 1 CPU device, competitor on "
            "core 1 (validation loss against training seconds)")
  if _MODE.value in ("all", "emulated") and not _FROM_RAW.value:
    t0 = time.perf_counter()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, me, "--role=emulated"] + args, env=env, check=True,
                   timeout=_TIMEOUT.value)
    seconds["emulated"] = time.perf_counter() - t0
  if _MODE.value in ("all", "emulated") and os.path.exists(emulated_raw):
    with open(emulated_raw) as f:
      raw = json.load(f)
    results["emulated"] = sb.summarize(raw)
    results["emulated_settings"] = raw["settings"]
    sb.plot(raw, os.path.join(out, "emulated.png"), "emulated replicas on 8 fake devices "
            "(validation loss against training seconds)")
  results["targets"] = sb.targets(results.get("emulated"), results.get("real"))
  if _FROM_RAW.value and os.path.exists(os.path.join(out, "results.json")):
    with open(os.path.join(out, "results.json")) as f:
      seconds = json.load(f).get("seconds", {})     # what the runs took
  results["seconds"] = seconds
  with open(os.path.join(out, "results.json"), "w") as f:
    json.dump(results, f, indent=1)
  md = ["# bench_ssaw" + (" (--quick)" if quick else ""), ""]
  if "real" in results:
    md.append(sb.markdown(results["real"], f"Real contention (2 processes; bursts {on_s:g} s "
                                           f"on / {off_s:g} s off)"))
  if "emulated" in results:
    md.append(sb.markdown(results["emulated"], "Emulated replicas (8 fake devices)"))
  md.append("Targets:")
  for t in results["targets"]:
    v = t["value"]
    shown = f"{v:.3f}" if isinstance(v, float) else str(v)
    md.append(f"- {t['target']}: {shown} ({'met' if t['met'] else 'NOT met'})")
  md.append("")
  md.append("Wall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()))
  text = "\n".join(md) + "\n"
  with open(os.path.join(out, "results.md"), "w") as f:
    f.write(text)
  print(text)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
