"""A barrier of every process of a job through JAX's coordination service: no XLA program.

`multihost_utils.sync_global_devices` waits by running an all-gather program over every device.
On XLA:CPU with gloo such a program has hung in one process after the other had finished it (two
processes: process 1 still in Orbax's first barrier while process 0 ran the next collective). A
barrier of the coordination service, which every `jax.distributed` job has, is the same wait
without a collective program, and cheaper on a cluster. `wait_for_all` is semijax's barrier;
`gather` hands every process the small JSON values of all (work split over the processes, such
as checksums, then shared); `route_orbax` sends Orbax's barriers there too.
"""

from __future__ import annotations

import itertools
import json

import jax
from absl import flags
from jax._src import distributed as jax_distributed   # the job's coordination service client
from jax.experimental import multihost_utils

_calls = itertools.count()     # every process calls the barriers in the same order
_ORBAX_FLAG = "experimental_orbax_use_distributed_barrier"


def wait_for_all(name: str, timeout_s: float = 600.0) -> None:
  """Returns once every process of the job has called `wait_for_all` with this name (in the same
  order as every other barrier); nothing with one process."""
  if jax.process_count() == 1:
    return
  client = jax_distributed.global_state.client
  if client is None:            # processes that share no coordination service
    multihost_utils.sync_global_devices(name)
    return
  client.wait_at_barrier(f"semijax/{next(_calls)}/{name}", int(timeout_s * 1000))


def gather(name: str, value, timeout_s: float = 600.0) -> list | None:
  """Every process's JSON-able `value`, in process order, once each has called `gather` with
  this name (in the same order as every other barrier): [value] with one process; None where
  the processes share no coordination service (the caller then does every process's part)."""
  if jax.process_count() == 1:
    return [value]
  client = jax_distributed.global_state.client
  if client is None:
    return None
  key = f"semijax/{next(_calls)}/{name}"
  client.key_value_set(f"{key}/{jax.process_index()}", json.dumps(value))
  out = [json.loads(client.blocking_key_value_get(f"{key}/{p}", int(timeout_s * 1000)))
         for p in range(jax.process_count())]
  client.wait_at_barrier(f"{key}/read", int(timeout_s * 1000))
  client.key_value_delete(f"{key}/{jax.process_index()}")
  return out


def route_orbax() -> None:
  """Makes Orbax wait at its barriers through the coordination service (its absl flag
  --experimental_orbax_use_distributed_barrier, which Orbax reads once absl has parsed the
  flags, as experiments/train.py does) instead of with an all-gather program."""
  import orbax.checkpoint  # noqa: F401  (defines the flag)
  if _ORBAX_FLAG in flags.FLAGS:
    flags.FLAGS[_ORBAX_FLAG].value = True
