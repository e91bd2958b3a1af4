r"""Accuracy study of ZERO-resizing: what a rotating straggler at keep 0.5 costs, per policy.

For a fixed budget of steps and several seeds, trains
  * gpt_tiny (configs/gpt_tiny.py:cpu, 8 tensor devices): the no-straggler baseline; every
    priority policy in `units` mode with the default imputation (zero, with freezing); every
    imputation policy in `units` mode with the default priority (weight_delta), without
    freezing so the imputation is what acts on skipped units; and the authors' setting
    (`contraction`, `weight_delta`, `fill`, no freezing);
  * vit_digits (configs/vit_digits.py:cpu): the baseline, the authors' setting and the best
    `units` setting of gpt_tiny.
The straggler is device `epoch mod 8`, keep 0.5, with `--rotations` rotations per run (an
"epoch" is steps / 8 / rotations steps, also the priority refresh interval). Evaluation is exact.

Writes results.json, results.md (final validation loss / accuracy, mean and std over seeds, and
the difference to the baseline) and val_loss.png under --out_dir. Runs live in
--out_dir/runs/<model>/<setting>/seed<k>; a rerun skips finished runs (they resume at their end).

  python experiments/study_resize.py               # the full study (about an hour on 2 cores)
  python experiments/study_resize.py --quick       # every setting, 1 seed, a few steps
"""

import sys

import json
import os
import time

from absl import app, flags
import jax
import numpy as np

# The repository root: benchmarks/ (benchmark and report code) lives beside the library.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.train import config as config_lib  # noqa: E402
from semijax.train import loop as train  # noqa: E402
from semijax.train import metrics  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUT = flags.DEFINE_string("out_dir", "results/study_resize", "Where to write the results.")
_QUICK = flags.DEFINE_bool("quick", False, "1 seed and a few steps per setting (minutes).")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per setting.")
_GPT_STEPS = flags.DEFINE_integer("gpt_steps", 300, "Training steps of each gpt_tiny run.")
_VIT_STEPS = flags.DEFINE_integer("vit_steps", 300, "Training steps of each vit_digits run.")
_ROTATIONS = flags.DEFINE_integer("rotations", 1, "Times the straggler visits every device.")
_EVALS = flags.DEFINE_integer("evals", 10, "Validation passes per run.")
_CACHE, _CACHE_DIR = cli.define_cache_flags()

NUM_DEVICES = 8
AUTHORS = dict(mode="contraction", priority="weight_delta", imputation="fill", freeze=False)
PRIORITY_SETTINGS = {f"units/{p}/zero+freeze": dict(mode="units", priority=p, imputation="zero",
                                                      freeze=True)
                     for p in ("weight_delta", "random", "window", "magnitude")}
IMPUTATION_SETTINGS = {f"units/weight_delta/{i}": dict(mode="units", priority="weight_delta",
                                                       imputation=i, freeze=False)
                       for i in ("zero", "fill", "rescale")}
GPT_SETTINGS = {"baseline": None, **PRIORITY_SETTINGS, **IMPUTATION_SETTINGS,
                "authors: contraction/weight_delta/fill": AUTHORS}


def make_config(model: str, resize: dict | None, seed: int, steps: int):
  config = config_lib.load(os.path.join(ROOT, "configs", f"{model}.py:cpu"))
  config.seed = seed
  config.steps = steps
  config.eval_every = max(steps // _EVALS.value, 1)
  config.log_every = config.eval_every
  config.checkpoint_every = 0
  if resize is not None:
    config.resize.straggler = "rotate"
    config.resize.straggler_keep = 0.5
    config.resize.epoch_steps = max(steps // (NUM_DEVICES * _ROTATIONS.value), 1)
    for k, v in resize.items():
      config.resize[k] = v
  return config


def run_one(model, name, resize, seed, steps) -> dict:
  """Trains one run (or finds it finished) and returns its validation curve."""
  workdir = os.path.join(_OUT.value, "runs", model, name.replace(": ", "_").replace("/", "-"),
                         f"seed{seed}")
  t0 = time.perf_counter()
  train.train_and_evaluate(make_config(model, resize, seed, steps), workdir)
  records = [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
             if "val/loss" in r]
  print(f"[{model} {name} seed {seed}] val loss {records[-1]['val/loss']:.4f} "
        f"({time.perf_counter() - t0:.0f} s)", flush=True)
  return {"steps": [r["step"] for r in records], "val_loss": [r["val/loss"] for r in records],
          "val_accuracy": [r["val/accuracy"] for r in records]}


def summarize(runs: list[dict]) -> dict:
  loss = np.array([r["val_loss"][-1] for r in runs])
  acc = np.array([r["val_accuracy"][-1] for r in runs])
  return {"val_loss_mean": float(loss.mean()), "val_loss_std": float(loss.std(ddof=1))
          if len(loss) > 1 else 0.0, "val_accuracy_mean": float(acc.mean()),
          "val_accuracy_std": float(acc.std(ddof=1)) if len(acc) > 1 else 0.0}


def run_model(model, settings, seeds, steps) -> dict:
  out = {}
  for name, resize in settings.items():
    runs = [run_one(model, name, resize, seed, steps) for seed in seeds]
    out[name] = {"resize": resize, "seeds": list(seeds), "runs": runs, **summarize(runs)}
  base = out["baseline"]
  for s in out.values():
    s["val_loss_vs_baseline"] = s["val_loss_mean"] - base["val_loss_mean"]
    s["val_accuracy_vs_baseline"] = s["val_accuracy_mean"] - base["val_accuracy_mean"]
  return out


def table(results: dict) -> str:
  rows = []
  for model, settings in results["models"].items():
    for name, s in settings.items():
      rows.append([model, name, f"{s['val_loss_mean']:.4f} ± {s['val_loss_std']:.4f}",
                   f"{s['val_loss_vs_baseline']:+.4f}",
                   f"{s['val_accuracy_mean']:.4f} ± {s['val_accuracy_std']:.4f}",
                   f"{s['val_accuracy_vs_baseline']:+.4f}"])
  return report.markdown_table(
      ["model", "setting (mode/priority/imputation)", "final val loss", "vs baseline",
       "final val accuracy", "vs baseline"], rows)


def plot(results: dict, path: str) -> None:
  plt = report.pyplot()
  if plt is None:
    return
  models = results["models"]
  fig, axes = plt.subplots(1, len(models), figsize=(7 * len(models), 4.5))
  for ax, (model, settings) in zip(np.atleast_1d(axes), models.items()):
    for name, s in settings.items():
      curve = np.mean([r["val_loss"] for r in s["runs"]], axis=0)
      style = dict(color="black", lw=2.5) if name == "baseline" else {}
      ax.plot(s["runs"][0]["steps"], curve, label=name, **style)
    ax.set(title=f"{model}: rotating straggler, keep 0.5 (mean of {len(s['seeds'])} seeds)",
           xlabel="step", ylabel="validation loss")
    ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  if jax.device_count() < NUM_DEVICES:
    raise app.UsageError(f"needs {NUM_DEVICES} devices; set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={NUM_DEVICES}")
  os.makedirs(_OUT.value, exist_ok=True)
  # Settings that differ only on the host (seed, priority policy) share compiled programs, and
  # so do later runs with another --out_dir (the cache is train.py's and the benchmarks').
  cli.apply_cache_flags(_CACHE, _CACHE_DIR)
  quick = _QUICK.value
  seeds = range(1 if quick else _SEEDS.value)
  gpt_steps = 24 if quick else _GPT_STEPS.value
  vit_steps = 24 if quick else _VIT_STEPS.value
  t0 = time.perf_counter()
  gpt = run_model("gpt_tiny", GPT_SETTINGS, seeds, gpt_steps)
  best = min((n for n in gpt if n.startswith("units/")), key=lambda n: gpt[n]["val_loss_mean"])
  vit = run_model("vit_digits", {"baseline": None, "authors: contraction/weight_delta/fill":
                                 AUTHORS, f"best units: {best}": GPT_SETTINGS[best]},
                  seeds, vit_steps)
  results = {"models": {"gpt_tiny": gpt, "vit_digits": vit}, "best_units_setting": best,
             "config": {"quick": quick, "seeds": list(seeds), "gpt_steps": gpt_steps,
                        "vit_steps": vit_steps, "rotations": _ROTATIONS.value,
                        "straggler_keep": 0.5, "tensor_devices": NUM_DEVICES},
             "jax": jax.__version__, "wall_time_s": time.perf_counter() - t0}
  md = table(results)
  with open(os.path.join(_OUT.value, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  with open(os.path.join(_OUT.value, "results.md"), "w") as f:
    f.write(md)
  plot(results, os.path.join(_OUT.value, "val_loss.png"))
  print(md)
  print(f"wrote {_OUT.value}/results.json, results.md, val_loss.png "
        f"({results['wall_time_s'] / 60:.1f} min)")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
