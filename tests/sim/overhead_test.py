"""The overhead figures: the speed samples' bytes are what `speed.gather_times` exchanges, and
the mesh stand-in gives `speed.tensor_times` what a real mesh does."""

import jax
import numpy as np
import pytest
from jax.experimental import multihost_utils

from semijax.balance import speed
from semijax.core import mesh as mesh_lib
from semijax.sim import overhead
from semijax.sim import profiles


@pytest.mark.parametrize("devices", [256, 4096])     # beyond the key-value store's processes
def test_sample_bytes_are_what_gather_times_all_gathers(monkeypatch, devices):
  processes = devices // overhead.DEVICES_PER_PROCESS
  seen = []

  def allgather(row):
    seen.append(np.asarray(row))
    return np.stack([row] * processes)

  monkeypatch.setattr(jax, "process_count", lambda: processes)
  monkeypatch.setattr(multihost_utils, "process_allgather", allgather)
  local = {i: 1.0 for i in range(overhead.DEVICES_PER_PROCESS)}
  speed.gather_times(local, 0.5)
  (row,) = seen
  assert processes * row.nbytes == overhead.sample_bytes(devices)


def test_the_mesh_stand_in_matches_a_real_mesh():
  real = mesh_lib.make_mesh(2, 4)
  times = {int(d.id): float(t) for d, t in zip(real.devices.flat, np.arange(8.0)[::-1] + 1)}
  stand_in = overhead._mesh(8, 4)  # pylint: disable=protected-access
  want = speed.tensor_times(real, times)
  ids = {int(d.id): i for i, d in enumerate(real.devices.flat)}
  remapped = {i: times[d] for d, i in ids.items()}
  assert np.array_equal(speed.tensor_times(stand_in, remapped), want)


def test_the_report_carries_the_planners_own_time():
  rows = overhead.measure(profiles.gpu_h100(0.03), sizes=(64,), steps=10)
  (row,) = rows
  planner = row["planner"]
  assert planner["seconds"] > 0 and planner["cluster_s"] > 0
  assert np.prod(planner["mesh"]) == 64 and sum(planner["stage_layers"]) == 32
  assert "| 64 |" in overhead.markdown(rows)
  (skipped,) = overhead.measure(profiles.gpu_h100(0.03), sizes=(64,), steps=10, planner_max=32)
  assert skipped["planner"] is None and "not run" in overhead.markdown([skipped])
