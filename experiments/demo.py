r"""Demo: one tensor device four times slower; even split vs a speed-proportional uneven split.

Trains `configs/gpt_tiny.py:cpu` twice on 8 (fake) devices with the same seed and data, with an
emulated straggler (a delay proportional to the work that device executes, DESIGN.md s4):
  * even: every device owns the same number of heads and MLP units;
  * proportional: each device owns units in proportion to its speed, so the slow device does a
    quarter of the work and is no longer the bottleneck.
Both compute the same model, so their losses agree; the uneven one is faster. Writes
demo.json, demo.md and step_time.png to --out_dir.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 python experiments/demo.py
"""

import os
import tempfile

from absl import app, flags
import jax
import numpy as np

from semijax import config_lib
from semijax import report
from semijax import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OUT = flags.DEFINE_string("out_dir", "results/demo", "Where to write the table and plot.")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps per run.")
_SLOW = flags.DEFINE_integer("slow_device", 3, "Index of the slow tensor device.")
_FACTOR = flags.DEFINE_float("slowdown", 4.0, "How many times slower the slow device is.")


def demo_config(steps: int, slowdown: tuple):
  config = config_lib.load(os.path.join(ROOT, "configs", "gpt_tiny.py:cpu"))
  config.steps = steps
  config.eval_every = steps
  config.log_every = max(steps // 6, 1)
  config.checkpoint_every = 0
  config.hetero.slowdown = slowdown
  return config


def run(name, config):
  with tempfile.TemporaryDirectory(prefix=f"semijax-demo-{name}-") as workdir:
    print(f"\n== {name}: mlp units {config.layout.mlp}, heads {config.layout.heads}", flush=True)
    return train.train_and_evaluate(config, workdir)


def main(argv):
  del argv
  n = 8
  if jax.device_count() < n:
    raise app.UsageError(f"the demo needs {n} devices, found {jax.device_count()}; set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={n}")
  slowdown = tuple(_FACTOR.value if d == _SLOW.value else 1.0 for d in range(n))
  even = demo_config(_STEPS.value, slowdown)
  proportional = config_lib.speed_proportional(even, slowdown)
  results = {"even": run("even", even), "proportional": run("proportional", proportional)}

  base = results["even"]["tokens_per_s"]
  rows, payload = [], {"slowdown": slowdown, "steps": _STEPS.value, "runs": {}}
  for (name, r), cfg in zip(results.items(), (even, proportional)):
    rows.append([name, str(config_lib.parse_counts(cfg.layout.mlp, "mlp")),
                 str(config_lib.parse_counts(cfg.layout.heads, "heads")),
                 r["mean_step_time_s"] * 1e3, r["tokens_per_s"], r["tokens_per_s"] / base,
                 r["val/loss"]])
    payload["runs"][name] = {k: r[k] for k in ("mean_step_time_s", "tokens_per_s", "val/loss",
                                               "val/accuracy", "step_times_s", "losses")}
    payload["runs"][name]["layout"] = {"mlp": cfg.layout.mlp, "heads": cfg.layout.heads}
  payload["speedup"] = results["proportional"]["tokens_per_s"] / base
  payload["max_abs_loss_difference"] = float(np.max(np.abs(
      np.asarray(results["even"]["losses"]) - np.asarray(results["proportional"]["losses"]))))
  table = report.markdown_table(
      ["layout", "MLP units per device", "heads per device", "ms/step", "tokens/s",
       "throughput vs even", "final val loss"], rows)
  table += (f"\nDevice {_SLOW.value} is {_FACTOR.value:g}x slower (emulated). Largest difference "
            f"between the two runs' training losses over {_STEPS.value} steps: "
            f"{payload['max_abs_loss_difference']:.2e}.\n")
  paths = report.write(_OUT.value, "demo", payload, table)
  plt = report.pyplot()
  if plt is not None:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
      ax.plot(np.arange(2, len(r["step_times_s"]) + 1), np.asarray(r["step_times_s"][1:]) * 1e3,
              label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"GPT on 8 devices, device {_SLOW.value} {_FACTOR.value:g}x slower")
    ax.legend()
    fig.tight_layout()
    paths["plot"] = os.path.join(_OUT.value, "step_time.png")
    fig.savefig(paths["plot"], dpi=120)
  print("\n" + table)
  print("wrote " + ", ".join(paths.values()))


if __name__ == "__main__":
  app.run(main)
