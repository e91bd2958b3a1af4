r"""semi's accuracy against even over 3 seeds, on 2 emulated devices (a stand-in for the real
contention of the straggler benchmark, whose timing a loaded machine blurs).

  XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu \
      python experiments/study_semi_accuracy.py --out=results/study_semi_accuracy   # ~15 min

gpt_tiny (the cpu variant) on 2 fake devices for 300 steps per run, seeds 0-2: `steady` (device 1
2.5x slower throughout) and `bursts` (the 2.5x slowdown moving between the devices every 30
steps); policies even and semi (any balance field can be overridden with --balance, e.g.
--balance=skip_budget=0.9,resize_penalty=0 to let semi resize from the first steps). Writes
--out/accuracy.{json,md}: every run's final validation loss, tokens/s, migrations and resized
decisions, and per scenario the mean loss against even's.
"""

import os
import shutil
import sys

from absl import app, flags
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import report  # noqa: E402
from semijax.balance import decisions as decisions_lib  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.train import config as config_lib  # noqa: E402
from semijax.train import loop as train  # noqa: E402

SCENARIOS = {"steady": ((1.0, 2.5), 0), "bursts": ((2.5, 1.0), 30)}
_OUT = flags.DEFINE_string("out", "results/study_semi_accuracy", "Output directory.")
_STEPS = flags.DEFINE_integer("steps", 300, "Steps per run.")
_SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds 0 .. seeds-1.")
_BALANCE = flags.DEFINE_list("balance", [], "semi's config.balance overrides, as field=value.")


def run_config(policy: str, scenario: str, seed: int):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  c = config_lib.load(os.path.join(root, "configs", "gpt_tiny.py") + ":cpu,tensor=2")
  c.steps, c.eval_every, c.log_every = _STEPS.value, _STEPS.value, 100
  c.checkpoint_every, c.keep_checkpoints, c.seed = 0, 1, seed
  c.hetero.slowdown, c.hetero.rotate_every = SCENARIOS[scenario]
  c.hetero.device_gflops = 10.0      # the slow device's extra time: about a third of a step
  c.balance.policy, c.balance.num_widths, c.balance.capacity_factor = policy, 6, 1.5
  if policy == "semi":
    for item in _BALANCE.value:
      field, value = item.split("=", 1)
      c.balance[field] = type(c.balance[field])(value)
  return c


def main(argv):
  del argv
  out, cache, runs = os.path.abspath(_OUT.value), {}, {}
  for scenario in SCENARIOS:
    for seed in range(_SEEDS.value):
      for policy in ("even", "semi"):
        workdir = os.path.join(out, "runs", scenario, policy, str(seed))
        shutil.rmtree(workdir, ignore_errors=True)
        s = train.train_and_evaluate(run_config(policy, scenario, seed), workdir,
                                     engine_cache=cache)
        logged = decisions_lib.read(workdir) if policy == "semi" else []
        runs.setdefault(scenario, {}).setdefault(policy, []).append(
            {"seed": seed, "final_val_loss": s["val/loss"], "tokens_per_s": s["tokens_per_s"],
             "migrations": s["balance"]["migrations"],
             "resized_decisions": sum(d.get("keep") is not None for d in logged)})
  rows, summary = [], {}
  for scenario, cells in runs.items():
    even = np.array([r["final_val_loss"] for r in cells["even"]])
    semi = np.array([r["final_val_loss"] for r in cells["semi"]])
    summary[scenario] = {"mean_val_loss_vs_even": float(semi.mean() / even.mean() - 1),
                         "per_seed_vs_even": (semi / even - 1).tolist()}
    rows.append([scenario, f"{even.mean():.4f}", f"{semi.mean():.4f}",
                 f"{summary[scenario]['mean_val_loss_vs_even']:+.2%}",
                 ", ".join(f"{v:+.2%}" for v in semi / even - 1),
                 sum(r["resized_decisions"] for r in cells["semi"])])
  table = report.markdown_table(["scenario", "even mean val loss", "semi mean val loss",
                                 "semi vs even", "per seed", "semi resized decisions"], rows)
  payload = {"steps": _STEPS.value, "balance": _BALANCE.value, "runs": runs, "summary": summary}
  paths = report.write(out, "accuracy", payload, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
