"""The planner benchmark's pieces: its clusters are what its doc says, a small run writes JSON
and a table whose planner row is the fastest, and experiments/plan.py plans from flags."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from benchmarks import planner
from benchmarks import report
from semijax.planner import plan as plan_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL_GPT = dict(vocab_size=512, seq_len=256, d_model=256, num_heads=8, d_ff=1024, num_layers=8)


def test_clusters_spread_types_over_regions():
  c = planner.make_cluster(64, 16, 4)
  assert c.num_devices == 64 and len(set(c.classes().tolist())) == 16
  for r in range(4):
    speeds = c.speeds[c.regions == r]
    assert len(speeds) == 16 and len(set(speeds.tolist())) == 4
  assert c.speeds.max() == 1.0 and np.isclose(c.speeds.min(), 0.25)
  assert c.group_link(np.flatnonzero(c.regions == 0)) == planner.INTRA
  assert c.group_link([0, 63]) == planner.INTER


def test_a_small_run_writes_its_table(tmp_path):
  result = planner.run(sizes=(32,), types=8, regions=2, global_batch=64, microbatch_sizes=(1, 2),
                       repeats=1, quality_cases=2, fields=SMALL_GPT, quality_work=500)
  plans = result["sizes"]["32"]["plans"]
  assert set(plans) == {"megatron", "even_pipeline", "compute_only", "full"}
  assert all(plans["full"]["predicted_s"] <= p["predicted_s"] * (1 + 1e-9)
             for p in plans.values())
  assert len(result["quality"]["gaps"]) == 2 and min(result["quality"]["gaps"]) >= -1e-9
  text = planner.table(result)
  paths = report.write(str(tmp_path), "planner", result, text)
  assert json.load(open(paths["json"]))["sizes"]["32"]["planner_s"] > 0
  assert "| 32 | full |" in open(paths["md"]).read()


@pytest.mark.slow
def test_plan_entry_point(tmp_path):
  out = tmp_path / "plan.json"
  run = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "plan.py"),
       "--config", os.path.join(ROOT, "configs", "gpt_tiny.py") + ":cpu",
       "--cluster=2x1.0@1G,2x0.5@1G;4x0.7@1G", "--microbatch_sizes=1,2", "--baselines",
       f"--out={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert run.returncode == 0, run.stderr[-2000:]
  assert "predicted step" in run.stdout and "even_pipeline" in run.stdout
  saved = json.load(open(out))
  assert set(saved["baselines"]) == {"megatron", "even_pipeline", "compute_only", "full"}
  # The plan's own fields sit at the top level, so a run can load the file as its plan.
  fields = {f.name for f in dataclasses.fields(plan_lib.Plan)} - {"predicted_s", "breakdown"}
  plan = plan_lib.Plan(**{k: v for k, v in saved.items() if k in fields})
  assert plan.num_devices == 8 and plan.global_batch == saved["request"]["global_batch"]
  assert saved["predicted_s"] == saved["baselines"]["full"]["predicted_s"]
  bad = subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", "plan.py"),
       "--config", os.path.join(ROOT, "configs", "gpt_tiny.py") + ":cpu", "--cluster=2y1.0"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert bad.returncode != 0 and bad.stderr.strip().splitlines()[-1].startswith("--cluster")
