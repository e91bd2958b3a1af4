"""Model FLOPs of training and the peak rates MFU is measured against.

A training step does three times the forward FLOPs of its examples (forward, and a backward of
twice that); the forward FLOPs of one token are every block's units (`ModelSpec.flops_per_unit`
times the units of each kind, per layer) plus the unsplit work outside the blocks (the
embedding, the final norm, the head and the loss: `ModelSpec.edge_flops`). Model FLOPs count
the model, not what the devices run: a padded slot, a repeated replicated op or a recomputation
is not in them, so MFU is comparable across layouts and with other code.

`PEAK_TFLOPS` holds dense peaks (datasheets, without sparsity) by compute dtype and device kind,
matched as a substring of `jax.Device.device_kind`. On NVIDIA GPUs float32 matmuls run in TF32
under JAX's default matmul precision, so float32 counts the TF32 peak; on TPUs they run in
bfloat16 passes, so float32 counts the bfloat16 peak.
"""

from __future__ import annotations

from semijax.core import spec as spec_lib

# TPU peaks per chip (one JAX device): v4 275, v5e ("TPU v5 lite") 197, v5p 459, v6e ("TPU v6
# lite") 918 bfloat16 TFLOP/s.
_TPU = {"TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
        "TPU v6 lite": 918.0}

# {compute dtype: {device kind substring: TFLOP/s}}; the first matching substring wins, so a
# kind that is a prefix of another comes after it ("L40S" before "L4", "TPU v5 lite" before
# "TPU v5"); the H100's PCIe and NVL parts are slower than its SXM part ("H100 80GB HBM3").
PEAK_TFLOPS = {
    "float32": {"H200": 494.7, "H100 PCIe": 378.0, "H100 NVL": 417.5, "H100": 494.7,
                "A100": 156.0, "L40S": 183.0, "L4": 60.0, "A10": 62.5, **_TPU},
    "bfloat16": {"H200": 989.4, "H100 PCIe": 756.5, "H100 NVL": 835.5, "H100": 989.4,
                 "A100": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0, **_TPU},
}
PEAK_TFLOPS["float16"] = PEAK_TFLOPS["bfloat16"]


def peak_tflops(device_kind: str, given: float = 0.0, dtype: str = "float32") -> float | None:
  """`given` if positive, else the table's peak for `device_kind` computing in `dtype`, else None
  (unknown: a CPU, or a device the table lacks)."""
  if given > 0:
    return float(given)
  table = PEAK_TFLOPS.get(dtype, {})
  return next((v for k, v in table.items() if k.lower() in device_kind.lower()), None)


def forward_flops_per_token(spec: spec_lib.ModelSpec) -> float:
  """Forward FLOPs of one token through the whole model (see module doc)."""
  per_unit, units, edge = spec.flops_per_unit(), spec.num_units(), spec.edge_flops()
  blocks = spec.num_layers * sum(per_unit[k] * units[k] for k in units)
  return float(blocks + edge["first"] + edge["last"])


def train_flops_per_example(spec: spec_lib.ModelSpec) -> float:
  """Model FLOPs of training on one example: 3 x forward over its `seq_len` tokens."""
  return 3.0 * spec.seq_len * forward_flops_per_token(spec)
