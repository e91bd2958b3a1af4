"""Benchmark and demo results as files: JSON, a short markdown table, and optional plots."""

from __future__ import annotations

import json
import os
from typing import Sequence


def fmt(v, spec: str) -> str:
  """`v` in format `spec` for a table cell, or "–" where there is no figure (None)."""
  return "–" if v is None else format(v, spec)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence]) -> str:
  """A GitHub markdown table; floats get 3 significant decimals."""
  fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


def write(out_dir: str, name: str, payload: dict, table: str) -> dict:
  """Writes `name`.json and `name`.md under out_dir, each whole or not at all (a benchmark
  killed by its time limit while rewriting them leaves the previous round's); returns their
  paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = {"json": os.path.join(out_dir, f"{name}.json"), "md": os.path.join(out_dir, f"{name}.md")}
  texts = {"json": json.dumps(payload, indent=2, sort_keys=True), "md": table}
  for kind, path in paths.items():
    with open(path + ".tmp", "w") as f:
      f.write(texts[kind])
    os.replace(path + ".tmp", path)
  return paths


def pyplot():
  """matplotlib.pyplot with a file-only backend, or None if matplotlib is not installed."""
  try:
    import matplotlib
  except ImportError:
    return None
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt
