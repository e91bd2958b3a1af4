"""Model FLOPs of training counted by hand, and the peak table MFU divides by."""

import pytest

from semijax.core import flops
from semijax.models import gpt, vit


def test_a_gpts_training_flops_per_example_counted_by_hand():
  spec = gpt.GPT.spec(vocab_size=256, seq_len=64, d_model=256, num_heads=16, d_ff=1024,
                      num_layers=2)
  # Per token, forward, per layer: Q, K, V and the output projection 4 x 2 x 256 x 256; scores
  # and values 2 x 2 x 64 x 256 / 2 (causal); the MLP 2 GEMMs x 2 x 256 x 1024. Outside the
  # blocks: the position add (256), the final LayerNorm, the head 2 x 256 x 256 and the softmax
  # cross-entropy 5 x 256. Training: 3 x forward, over 64 tokens.
  layer = 8 * 256 * 256 + 2 * 64 * 256 + 4 * 256 * 1024
  edge = 256 + flops.spec_lib.LAYERNORM_FLOPS * 256 + 2 * 256 * 256 + 5 * 256
  assert flops.train_flops_per_example(spec) == 3 * 64 * (2 * layer + edge)


def test_training_flops_grow_with_every_dimension():
  base = dict(num_classes=10, image_size=8, patch_size=4, channels=1, d_model=32,
              num_heads=4, d_ff=64, num_layers=2)
  small = flops.train_flops_per_example(vit.ViT.spec(**base))
  for field, more in (("d_model", 64), ("d_ff", 128), ("num_layers", 3), ("image_size", 16)):
    bigger = flops.train_flops_per_example(vit.ViT.spec(**dict(base, **{field: more})))
    assert bigger > small, field


# TF32 tensor-core peaks (TFLOP/s) with 2:4 sparsity, as NVIDIA's datasheets print them, by the
# `device_kind` JAX reports; the dense peak is half.
SPARSE_TF32 = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.0,
               "NVIDIA H100 NVL": 835.0,
               "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 366.0, "NVIDIA L4": 120.0,
               "NVIDIA A10": 125.0}

# Dense bfloat16 peaks (TFLOP/s), as the datasheets print them (TPUs per chip).
DENSE_BF16 = {"NVIDIA H200": 989.4, "NVIDIA H100 80GB HBM3": 989.4, "NVIDIA H100 PCIe": 756.5,
              "NVIDIA H100 NVL": 835.5,
              "NVIDIA A100-SXM4-80GB": 312.0, "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0,
              "NVIDIA A10": 125.0, "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5p": 459.0,
              "TPU v6 lite": 918.0}


def test_peak_tflops_is_the_datasheets_dense_peak_of_the_reported_kind():
  # "L40S" and "L4", "A100" and "A10", "TPU v5 lite" and "TPU v5p", the H100's SXM, PCIe and
  # NVL parts share a prefix: each kind must find its own row.
  for kind, sparse in SPARSE_TF32.items():
    assert flops.peak_tflops(kind) == pytest.approx(sparse / 2), kind
    assert flops.peak_tflops(kind.lower()) == flops.peak_tflops(kind), kind
  for kind, dense in DENSE_BF16.items():
    assert flops.peak_tflops(kind, dtype="bfloat16") == dense, kind
    assert flops.peak_tflops(kind, dtype="float16") == dense, kind
    if kind.startswith("TPU"):       # float32 matmuls run in bfloat16 passes there
      assert flops.peak_tflops(kind) == dense, kind


def test_a_given_peak_wins_and_an_unknown_kind_has_none():
  assert flops.peak_tflops("cpu") is None and flops.peak_tflops("TPU v3") is None
  assert flops.peak_tflops("cpu", given=1.5) == 1.5
  assert flops.peak_tflops("NVIDIA H200", given=1.5) == 1.5          # over the table's
  assert flops.peak_tflops("NVIDIA H200", given=0.0) == flops.peak_tflops("NVIDIA H200")
