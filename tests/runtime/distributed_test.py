"""Joining a multi-process job: what is checked before jax.distributed is called."""

import pytest

from semijax import errors
from semijax.core import barrier
from semijax.core import transport
from semijax.runtime import distributed


def test_a_bad_environment_value_stops_a_multiprocess_start_before_jax_is_touched(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda *a, **k: calls.append(a))
  monkeypatch.setenv(transport.ENV, "lowest")
  with pytest.raises(errors.InputError, match=f"{transport.ENV}: 'lowest'"):
    distributed.initialize("127.0.0.1:1", 2, 0)
  assert calls == []
  distributed.initialize()          # one process: nothing is read, nothing fails


@pytest.mark.parametrize("env, cluster", [
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "1", "SLURM_NTASKS": "4"}, "slurm"),
    ({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, None),   # one task
    ({"SLURM_JOB_ID": "7"}, None),                                              # salloc shell
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:3", "OMPI_COMM_WORLD_SIZE": "2"}, "openmpi"),
    ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:3", "OMPI_COMM_WORLD_SIZE": "1"}, None),
    ({"TPU_WORKER_HOSTNAMES": "t-0,t-1"}, "tpu"),
    ({"TPU_WORKER_HOSTNAMES": "t-0"}, None),
    ({"MEGASCALE_COORDINATOR_ADDRESS": "t-0:8080"}, "tpu"),
    ({}, None),
])
def test_a_cluster_job_of_several_processes_joins_by_jaxs_own_detection(env, cluster,
                                                                        monkeypatch):
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda *a, **k: calls.append((a, k)))
  for name in ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_NTASKS", "OMPI_MCA_orte_hnp_uri",
               "OMPI_COMM_WORLD_SIZE", "TPU_WORKER_HOSTNAMES", "MEGASCALE_COORDINATOR_ADDRESS",
               "SEMIJAX_COORDINATOR", "SEMIJAX_NUM_PROCESSES", "SEMIJAX_PROCESS_ID",
               transport.ENV):
    monkeypatch.delenv(name, raising=False)
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  assert distributed.cluster_job() == cluster
  distributed.initialize()
  # Detected: initialize() with no address, so that JAX reads the cluster itself.
  assert calls == ([((), {"initialization_timeout": 300})] if cluster else [])
  calls.clear()
  distributed.initialize("127.0.0.1:1", 2, 1)          # given: as given, cluster or not
  assert calls == [(("127.0.0.1:1", 2, 1), {"initialization_timeout": 300})]


def test_a_job_routes_orbax_barriers_through_the_coordination_service(monkeypatch):
  # After jax.distributed is initialized, Orbax waits at its barriers through the coordination
  # service, not with an all-gather program (which has hung on XLA:CPU).
  from absl import flags
  flag = flags.FLAGS[barrier._ORBAX_FLAG]          # the flag Orbax reads (once absl parsed)
  monkeypatch.setattr(flag, "value", False)
  monkeypatch.setattr(distributed.jax.distributed, "initialize", lambda *a, **k: None)
  distributed.initialize("127.0.0.1:1", 2, 0)
  assert flag.value is True


def test_one_process_waits_at_no_barrier(monkeypatch):
  monkeypatch.setattr(barrier.multihost_utils, "sync_global_devices",
                      lambda name: pytest.fail("a barrier with one process"))
  barrier.wait_for_all("alone")
