"""Joining a multi-process (multi-host) job through `jax.distributed`.

One process needs nothing. For several, give the coordinator address, the process count and this
process's id (flags of experiments/train.py, or the environment variables SEMIJAX_COORDINATOR,
SEMIJAX_NUM_PROCESSES, SEMIJAX_PROCESS_ID), or `auto=True` on a cluster JAX can detect by itself
(SLURM, Cloud TPU, ...). On CPU, collectives between processes go through gloo.
"""

from __future__ import annotations

import os

import jax

from semijax import errors
from semijax.core import transport


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *, auto: bool = False,
               timeout_s: int = 300) -> None:
  """Calls jax.distributed.initialize when a multi-process job is described; else does nothing.

  Must run before anything touches a JAX backend.

  Raises:
    errors.InputError: several processes but no coordinator address, or a bad
      SEMIJAX_TRANSPORT_NICE (`core.transport`).
  """
  env = os.environ
  coordinator_address = coordinator_address or env.get("SEMIJAX_COORDINATOR") or None
  if num_processes is None and "SEMIJAX_NUM_PROCESSES" in env:
    num_processes = int(env["SEMIJAX_NUM_PROCESSES"])
  if process_id is None and "SEMIJAX_PROCESS_ID" in env:
    process_id = int(env["SEMIJAX_PROCESS_ID"])
  if not auto and coordinator_address is None:
    if num_processes not in (None, 1):
      raise errors.InputError(f"--num_processes: {num_processes} processes need "
                              "--coordinator_address (host:port of process 0)")
    return
  transport.nice_value()   # a bad SEMIJAX_TRANSPORT_NICE fails here, before anything compiles
  if "cpu" in (env.get("JAX_PLATFORMS") or "cpu").split(","):
    # CPU processes exchange collectives through gloo (no-op where another backend is used).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if auto:
    jax.distributed.initialize(initialization_timeout=timeout_s)
  else:
    jax.distributed.initialize(coordinator_address, num_processes, process_id,
                               initialization_timeout=timeout_s)
