"""The probe benchmark's reading of a run: medians of a hand-written workdir's decisions and
metrics, and a smoke run of experiments/bench_probe.py (what scripts/gpu_bench.sh runs)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import probe_cost

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_probes_cost_and_the_runs_mfu_are_read_from_its_workdir(tmp_path):
  decisions = [{"step": 0, "sample_s": 9.0, "measured_s": 1.0, "speeds": [1, 1]},   # trial
               {"step": 4, "sample_s": 0.002, "measured_s": 0.10, "speeds": [1, 0.5]},
               {"step": 8, "sample_s": 0.004, "measured_s": 0.12, "speeds": [1, 0.4]},
               {"step": 12, "sample_s": 0.003, "measured_s": 0.08, "speeds": [1, 0.45]}]
  (tmp_path / "decisions.jsonl").write_text("".join(json.dumps(d) + "\n" for d in decisions))
  records = [{"step": 1, "train/mfu": 0.01, "train/tflops_per_device": 1.0},     # cold
             {"step": 2, "train/mfu": 0.30, "train/tflops_per_device": 30.0},
             {"step": 3, "train/mfu": 0.40, "train/tflops_per_device": 40.0},
             {"step": 4, "train/tflops_per_device": 50.0}]                       # no peak
  (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
  out = probe_cost.summarize(str(tmp_path), probe_every=4)
  assert out["samples"] == 3
  assert out["sample_s"] == {"median": 0.003, "min": 0.002, "max": 0.004}
  assert out["step_s"] == {"median": 0.10, "min": 0.08, "max": 0.12}
  assert out["sample_share_of_step"] == pytest.approx(0.03)
  assert out["amortized_share"] == pytest.approx(0.0075)
  assert out["speeds"] == [1, 0.45]
  assert out["mfu"] == {"median": pytest.approx(0.35), "min": 0.30, "max": 0.40}
  assert out["tflops_per_device"]["median"] == 40.0


@pytest.mark.slow
def test_bench_probe_smoke_run_on_cpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2")
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_probe.py"),
                  "--model=tiny", "--steps=8", "--peak_tflops=1", f"--out_dir={tmp_path}"],
                 check=True, env=env, cwd=ROOT, timeout=300, capture_output=True)
  with open(tmp_path / "bench_probe.json") as f:
    out = json.load(f)
  assert out["tensor"] == 2 and out["samples"] >= 1 and out["sample_s"]["median"] > 0
  assert 1 <= out["probe_passes"] <= 64        # sized to balance.probe_budget
  assert 0 < out["mfu"]["median"] == pytest.approx(out["tflops_per_device"]["median"], rel=1e-9)
  assert (tmp_path / "bench_probe.md").read_text().startswith("| device |")
