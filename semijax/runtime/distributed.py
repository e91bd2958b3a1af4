"""Joining a multi-process (multi-host) job through `jax.distributed`.

One process needs nothing. For several, give the coordinator address, the process count and this
process's id (flags of experiments/train.py, or the environment variables SEMIJAX_COORDINATOR,
SEMIJAX_NUM_PROCESSES, SEMIJAX_PROCESS_ID). Without them, a job of several processes that a
cluster manager started (`cluster_job`: a SLURM step, an Open MPI run, the hosts of a Cloud TPU
pod slice on GKE or of a multislice job) joins through `jax.distributed.initialize()`'s own
detection, with no flags; `auto=True` asks for that detection anyway (a Cloud TPU VM pod, which
only its metadata server describes). On CPU, collectives between processes go through gloo.
"""

from __future__ import annotations

import os

import jax

from semijax import errors
from semijax.core import barrier
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
  if coordinator_address is None and num_processes is None and cluster_job(env):
    auto = True
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
  barrier.route_orbax()


def _count(value: str | None) -> int:
  try:
    return int(value or 0)
  except ValueError:
    return 0


def cluster_job(env=None) -> str | None:
  """The cluster manager that started this process as one of several, or None: "slurm" (an
  srun step of several tasks), "openmpi" (mpirun of several ranks) or "tpu" (several TPU
  hosts: TPU_WORKER_HOSTNAMES lists more than one, or a multislice coordinator is set)."""
  env = os.environ if env is None else env
  if "SLURM_JOB_ID" in env and "SLURM_PROCID" in env and _count(env.get("SLURM_NTASKS")) > 1:
    return "slurm"
  if "OMPI_MCA_orte_hnp_uri" in env and _count(env.get("OMPI_COMM_WORLD_SIZE")) > 1:
    return "openmpi"
  hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
  if len(hosts) > 1 or "MEGASCALE_COORDINATOR_ADDRESS" in env:
    return "tpu"
  return None
