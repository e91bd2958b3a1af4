"""The GPU benchmark's CPU-runnable parts: model FLOPs of a step by hand, the peak table, and a
smoke run of experiments/bench_mfu.py (the same script scripts/gpu_bench.sh runs on a GPU)."""

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


# TF32 tensor-core peaks (TFLOP/s) with 2:4 sparsity, as NVIDIA's datasheets print them, by the
# `device_kind` JAX reports; the dense peak is half.
SPARSE_TF32 = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4,
               "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 366.0, "NVIDIA L4": 120.0,
               "NVIDIA A10": 125.0}


# Dense bfloat16 tensor-core peaks (TFLOP/s), as the datasheets print them.
DENSE_BF16 = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4,
              "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0,
              "NVIDIA A10": 125.0}


def test_peak_tflops_is_the_datasheets_dense_peak_of_the_reported_kind():
  # "L40S" and "L4", "A100" and "A10" share a prefix: each kind must find its own row.
  for kind, sparse in SPARSE_TF32.items():
    assert mfu.peak_tflops(kind) == pytest.approx(sparse / 2), kind
    assert mfu.peak_tflops(kind.lower()) == mfu.peak_tflops(kind), kind
    assert mfu.peak_tflops(kind, dtype="bfloat16") == DENSE_BF16[kind], kind
    assert mfu.peak_tflops(kind, dtype="float16") == DENSE_BF16[kind], kind


def test_a_given_peak_wins_and_an_unknown_kind_has_none():
  assert mfu.peak_tflops("cpu") is None and mfu.peak_tflops("TPU v4") is None
  assert mfu.peak_tflops("cpu", given=1.5) == 1.5
  assert mfu.peak_tflops("NVIDIA H200", given=1.5) == 1.5          # over the table's
  assert mfu.peak_tflops("NVIDIA H200", given=0.0) == mfu.peak_tflops("NVIDIA H200")


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
