"""A benchmark's 2 processes, pinned to cores 0 and 1: run them, read what each wrote."""

from __future__ import annotations

import json
import os

from semijax.runtime import launch


def run(argv: list[str], out: str, name: str, *, timeout_s: float,
        env: dict | None = None) -> list[dict]:
  """Runs `argv` as 2 processes of one jax.distributed job (one CPU device each, logs under
  out/logs) and returns the JSON each wrote to out/<name>_process<i>.json.

  Raises:
    SystemExit: a process failed (with the tail of its log).
  """
  res = launch.launch(argv, 2, cores=[[0], [1]], devices_per_process=1, timeout_s=timeout_s,
                      log_dir=os.path.join(out, "logs"), env=env)
  if not res.ok:
    raise SystemExit(res.failure_message())
  per_process = []
  for i in range(2):
    with open(os.path.join(out, f"{name}_process{i}.json")) as f:
      per_process.append(json.load(f))
  return per_process
