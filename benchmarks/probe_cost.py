"""What the speed probe costs and what MFU a run reports, read from a run's workdir.

A controlled policy (`semi`) measuring with `balance.measure=probe` logs every decision in
decisions.jsonl with the seconds its sample took (`sample_s`: the probe on every local device
at once, and sharing the numbers) and the mean step time since the last sample (`measured_s`);
metrics.jsonl has every record's `train/mfu` and `train/tflops_per_device`. `summarize` turns
them into medians (with min and max): the probe's seconds per sample, as a share of a step and
amortized over `probe_every` steps, and the run's MFU.
"""

from __future__ import annotations

import json
import os

import numpy as np

from semijax.train import metrics as metrics_lib


def _spread(values) -> dict | None:
  """{"median", "min", "max"} of `values`, or None if there are none."""
  values = [float(v) for v in values if v is not None]
  if not values:
    return None
  return {"median": float(np.median(values)), "min": min(values), "max": max(values)}


def summarize(workdir: str, probe_every: int) -> dict:
  """{"samples", "sample_s", "step_s", "sample_share_of_step", "amortized_share", "speeds",
  "mfu", "tflops_per_device"} of the run in `workdir` (the first record, which includes
  compilation-cold caches, and the warm-up's trial sample left out)."""
  with open(os.path.join(workdir, "decisions.jsonl")) as f:
    decisions = [json.loads(line) for line in f if line.strip()][1:]
  records = metrics_lib.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[1:]
  sample_s = _spread(d.get("sample_s") for d in decisions)
  step_s = _spread(d.get("measured_s") for d in decisions)
  share = None if not (sample_s and step_s) else sample_s["median"] / step_s["median"]
  return {"samples": len(decisions), "sample_s": sample_s, "step_s": step_s,
          "sample_share_of_step": share,
          "amortized_share": None if share is None else share / probe_every,
          "speeds": decisions[-1]["speeds"] if decisions else None,
          "mfu": _spread(r.get("train/mfu") for r in records),
          "tflops_per_device": _spread(r.get("train/tflops_per_device") for r in records)}
