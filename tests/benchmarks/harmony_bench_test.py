"""benchmarks/harmony.py's bookkeeping on made-up records: medians, paired ratios, the time to
the target loss, the ideal step and the targets."""

import os

import numpy as np
import pytest

import helpers as H
from benchmarks import harmony
from semijax.train import config as config_lib


def record(step_s, predicted, losses):
  val = [[k + 1, float(np.sum(step_s[:k + 1])), loss] for k, loss in enumerate(losses)]
  plan = {"data": 1, "pipe": 1, "tensor": 8, "stage_layers": [8], "microbatches": [1]}
  return {"plan": plan, "predicted_s": predicted, "step_times_s": list(step_s), "losses": losses,
          "val": val}


def test_summary_ratios_targets_and_time_to_loss():
  run = config_lib.validate(harmony.scenario_config(4, 1), 8)
  losses = [3.0, 2.5, 2.0, 1.9]
  records = {"megatron": record([9, 4, 4, 4.2], 4.0, losses),
             "even_pipeline": record([9, 5, 5, 5], 5.0, losses),
             "compute_only": record([9, 8, 8, 8], 8.0, [3.0, 2.6, 2.1, 2.0]),
             "full": record([9, 3, 3.1, 3], 3.0, losses)}
  out = harmony.summarize(records, harmony.ideal_step_s(run), run)
  assert out["target_val_loss"] == 2.0           # the highest final loss: everyone reaches it
  full, meg = out["strategies"]["full"], out["strategies"]["megatron"]
  assert full["median_step_s"] == 3.0 and meg["median_step_s"] == 4.0   # first step left out
  assert out["best_baseline"] == "megatron" and out["full_over_best"] == pytest.approx(4 / 3)
  assert meg["full_speedup_paired"] == pytest.approx(4 / 3)
  assert full["target_step"] == 3 and full["time_to_target_s"] == pytest.approx(15.1)
  assert out["strategies"]["compute_only"]["target_step"] == 4
  assert full["prediction_error"] == pytest.approx(0.0)
  assert out["targets"]["met"]
  # Total work over total speed: 4x the forward of every unit of every layer and of the
  # embedding and head once, at speed 6.
  spec = run.model
  flops = spec.flops_per_unit()
  edge = spec.edge_flops()
  tokens = run.batch_size * spec.seq_len
  per_token = (spec.num_layers * (flops["mlp"] * spec.d_ff + flops["heads"] * spec.num_heads)
               + edge["first"] + edge["last"])
  want = 4 * per_token * tokens / (run.hetero.device_gflops * 1e9) / 6.0
  assert out["ideal_step_s"] == pytest.approx(want)
  assert "NOT met" not in harmony.table(out)


def test_the_scenario_config_is_the_readme_one():
  c = config_lib.load(harmony.CONFIG)
  run = config_lib.validate(c, 8)
  assert run.pipeline is not None and run.mesh.pipe == 2 and run.model.num_layers == 8
  assert list(run.pipeline.devices.speeds) == [1, 1, 1, 1, .5, .5, .5, .5]
  assert os.path.samefile(harmony.CONFIG, os.path.join(H.ROOT, "configs", "gpt_harmony.py"))
  c.pipeline.layers = "5,1"
  with pytest.raises(config_lib.ConfigError, match="config.pipeline.layers"):
    config_lib.validate(c, 8)
