"""The GPU benchmark's CPU-runnable parts: model FLOPs of a step by hand (the peak table is
the library's: tests/core/flops_test.py), and a smoke run of experiments/bench_mfu.py (the same script scripts/gpu_bench.sh runs on a GPU)."""

import json
import os
import subprocess
import sys

import pytest

from benchmarks import mfu
from semijax.models import gpt

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_step_flops_counted_by_hand():
  spec = gpt.GPT.spec(vocab_size=256, seq_len=64, d_model=256, num_heads=16, d_ff=1024,
                      num_layers=2)
  # Per token, forward: an MLP unit 2 GEMMs x 2 x 256; a head (16 wide) 4 GEMMs x 2 x 256 x 16
  # plus scores and values 2 x 2 x 64 x 16 / 2 (causal); the head 2 x 256 x 256. Times 3.
  mlp, head = 4 * 256, 8 * 256 * 16 + 2 * 64 * 16
  want = 3 * 1024 * (2 * (512 * mlp + 8 * head) + 2 * 256 * 256)
  assert mfu.step_flops(spec, {"mlp": 512, "heads": 8}, tokens=1024, vocab_size=256) == want


@pytest.mark.slow
def test_bench_mfu_smoke_run_on_cpu(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_mfu.py"),
                  "--model=tiny", "--num_widths=2", "--steps=1", "--peak_tflops=1",
                  "--dtype=bfloat16",
                  f"--out_dir={tmp_path}"], check=True, env=env, cwd=ROOT, timeout=300,
                 capture_output=True)
  with open(tmp_path / "bench_mfu.json") as f:
    out = json.load(f)
  assert [r["mlp_width"] for r in out["widths"]] == [64, 128] and out["dtype"] == "bfloat16"
  for r in out["widths"]:
    assert r["single"]["step_s"] > 0 and 0 < r["single"]["mfu"] == pytest.approx(
        r["single"]["tflops"] / 1.0)
  assert (tmp_path / "bench_mfu.md").read_text().startswith("| mlp width |")


def test_gpu_script_is_valid_bash():
  subprocess.run(["bash", "-n", os.path.join(ROOT, "scripts", "gpu_bench.sh")], check=True)
