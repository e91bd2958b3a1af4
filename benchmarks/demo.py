"""The README demo as library functions (used by experiments/demo.py and the quickstart notebook).

One tensor device is emulated `factor` times slower. `gpt_tiny:cpu` (or another config, e.g.
`llama_tiny:cpu`) is trained three times with the same seed and data:
  even          plain TP: every device owns the same share, the straggler holds everyone up;
  proportional  the oracle: a fixed split proportional to the (known) speeds;
  semi          SEMI-migration: starts from the even split, measures the speeds (a trial step at
                the end of warm-up, then while training) and decides online (here: migrate units
                off the slow device, before the first step).
Even and proportional compute the same model, so their losses agree; semi's losses leave them
only while it resizes.
"""

from __future__ import annotations

import copy
import os
import tempfile

import numpy as np

from benchmarks import report
from semijax.runtime import hostcpu
from semijax.train import config as config_lib
from semijax.train import loop as train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NUM_DEVICES = 8
DEFAULT_CONFIG = os.path.join(ROOT, "configs", "gpt_tiny.py:cpu")


def configs(steps: int, slow_device: int = 3, factor: float = 4.0,
            config_path: str = DEFAULT_CONFIG) -> dict:
  """{"even", "proportional", "semi": config}, all with the same emulated straggler."""
  slowdown = tuple(factor if d == slow_device else 1.0 for d in range(NUM_DEVICES))
  even = config_lib.load(config_path)
  even.steps = steps
  even.eval_every = steps
  even.log_every = max(steps // 6, 1)
  even.checkpoint_every = 0
  even.hetero.slowdown = slowdown
  semi = copy.deepcopy(even)
  semi.balance.policy = "semi"
  semi.balance.num_widths = 8     # room to move units in steps of 1/8 of the bucket
  return {"even": even, "proportional": config_lib.speed_proportional(even, slowdown),
          "semi": semi}


def run(name: str, config) -> dict:
  """Trains `config` in a throw-away workdir and returns train_and_evaluate's summary."""
  with tempfile.TemporaryDirectory(prefix=f"semijax-demo-{name}-") as workdir:
    print(f"\n== {name}: MLP units {config.layout.mlp}, heads {config.layout.heads}", flush=True)
    return train.train_and_evaluate(config, workdir)


def summarize(results: dict, cfgs: dict) -> tuple[dict, str]:
  """(JSON payload, markdown table) comparing the runs with the even split."""
  base = results["even"]["tokens_per_s"]
  rows, runs = [], {}
  for name, r in results.items():
    counts = r["balance"]["layout_counts"]         # at the end of the run
    mlp, heads = tuple(counts["mlp"]), tuple(counts["heads"])
    rows.append([name, str(mlp), str(heads), r["mean_step_time_s"] * 1e3, r["tokens_per_s"],
                 r["tokens_per_s"] / base, r["val/loss"], r["balance"]["migrations"],
                 r["balance"]["compiles_after_warmup"]])
    runs[name] = {k: r[k] for k in ("mean_step_time_s", "tokens_per_s", "val/loss",
                                    "val/accuracy", "step_times_s", "losses")}
    runs[name]["layout"] = {"mlp": mlp, "heads": heads}
    runs[name]["balance"] = {k: v for k, v in r["balance"].items() if k != "layout_counts"}
  slowdown = tuple(cfgs["even"].hetero.slowdown)
  diff = float(np.max(np.abs(np.subtract(results["even"]["losses"],
                                         results["proportional"]["losses"]))))
  payload = {"slowdown": slowdown, "steps": cfgs["even"].steps, "runs": runs,
             "speedup": results["proportional"]["tokens_per_s"] / base,
             "max_abs_loss_difference": diff}
  if "semi" in results:
    payload["semi_speedup"] = results["semi"]["tokens_per_s"] / base
    payload["semi_vs_proportional"] = (results["semi"]["tokens_per_s"] /
                                       results["proportional"]["tokens_per_s"])
  table = report.markdown_table(
      ["run", "MLP units per device (end)", "heads per device (end)", "ms/step", "tokens/s",
       "throughput vs even", "final val loss", "migrations", "compiles after warm-up"], rows)
  slow = int(np.argmax(slowdown))
  table += (f"\nDevice {slow} is {slowdown[slow]:g}x slower (emulated). Largest difference "
            f"between the even and proportional runs' training losses over "
            f"{cfgs['even'].steps} steps: {diff:.2e}.\n")
  return payload, table


def plot(results: dict, path: str, title: str = "") -> str | None:
  """Step time per step of each run (the first, warm-up step left out) as a PNG."""
  plt = report.pyplot()
  if plt is None:
    return None
  fig, ax = plt.subplots(figsize=(7, 4))
  for name, r in results.items():
    times = np.asarray(r["step_times_s"][1:]) * 1e3
    ax.plot(np.arange(2, len(times) + 2), times, label=name)
  ax.set_xlabel("step")
  ax.set_ylabel("step time (ms)")
  ax.set_ylim(bottom=0)
  ax.set_title(title)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def main(steps: int, slow_device: int, factor: float, out_dir: str,
         config_path: str = DEFAULT_CONFIG) -> dict:
  """Runs all three on `config_path`, writes demo.json, demo.md and step_time.png to out_dir;
  returns the payload (with the host's steal share over the three runs, `hostcpu`)."""
  cfgs = configs(steps, slow_device, factor, config_path)
  meter = hostcpu.StealMeter()
  results = {name: run(name, c) for name, c in cfgs.items()}
  payload, table = summarize(results, cfgs)
  payload["host_steal"] = meter.share()
  note = hostcpu.describe(payload["host_steal"])
  table += f"{note}\n" if note else ""
  paths = report.write(out_dir, "demo", payload, table)
  png = plot(results, os.path.join(out_dir, "step_time.png"),
             f"{cfgs['even'].model.name} on {NUM_DEVICES} devices, device {slow_device} "
             f"{factor:g}x slower")
  print("\n" + table)
  print("wrote " + ", ".join(list(paths.values()) + ([png] if png else [])))
  return payload
