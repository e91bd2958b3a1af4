"""The overhead figures: the speed samples' bytes are what `speed.gather_times` and
`sampling.KeyValueGather` exchange, the mesh stand-in gives `speed.tensor_times` what a real mesh
does, and the report's planner times and table cells are the measured ones."""

import threading

import jax
import numpy as np
import pytest
from jax._src import distributed as jax_distributed
from jax.experimental import multihost_utils

from semijax.balance import sampling
from semijax.balance import speed
from semijax.core import mesh as mesh_lib
from semijax.sim import overhead
from semijax.sim import planning
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


def test_sample_bytes_are_what_the_key_value_store_hands_each_process(monkeypatch):
  """64 devices are 8 processes, few enough to share samples through the key-value store: each
  process reads every process's record (its 8 devices' times and the step time). The estimate
  holds to a few percent for real times and device ids 0-63."""
  processes, per = 8, overhead.DEVICES_PER_PROCESS
  store, ready, read = {}, threading.Condition(), {}
  me = threading.local()

  class Client:
    def key_value_set(self, key, value):
      with ready:
        store[key] = value
        ready.notify_all()

    def blocking_key_value_get(self, key, timeout_ms):
      with ready:
        assert ready.wait_for(lambda: key in store, timeout=30), key
        read[me.p] = read.get(me.p, 0) + len(store[key])
        return store[key]

  monkeypatch.setattr(jax, "process_count", lambda: processes)
  monkeypatch.setattr(jax, "process_index", lambda: me.p)
  monkeypatch.setattr(jax_distributed.global_state, "client", Client())
  times = np.random.default_rng(0).uniform(0.05, 0.5, processes * per)
  gathers = [sampling.KeyValueGather() for _ in range(processes)]
  got = {}

  def process(p):
    me.p = p
    gathers[p].prefix = gathers[0].prefix          # every process makes its samplers in order
    local = {d: float(times[d]) for d in range(p * per, (p + 1) * per)}
    got[p] = gathers[p](local, float(times[p * per:(p + 1) * per].max()))

  threads = [threading.Thread(target=process, args=(p,)) for p in range(processes)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(60)
  assert got[0][0] == {d: float(t) for d, t in enumerate(times)}      # the exchange happened
  assert sorted(read) == list(range(processes))
  for p in range(processes):
    assert read[p] == pytest.approx(overhead.sample_bytes(64), rel=0.05), p


def table_cells(rows) -> dict:
  """{column: cell} of the one row of `overhead.markdown(rows)`."""
  header, _, line = overhead.markdown(rows).splitlines()
  return dict(zip(header.strip("| ").split(" | "), line.strip("| ").split(" | ")))


def test_the_report_carries_the_planners_own_time_and_the_rows_values(monkeypatch):
  """A fake clock advances 0.25 s while the planner's cluster is built and 1.5 s while it
  plans: the row reports exactly those, and the table's cells hold their columns' values."""
  clock = [0.0]
  monkeypatch.setattr(overhead, "time", type("Clock", (), {
      "perf_counter": staticmethod(lambda: clock[0])}))

  def advancing(fn, seconds):
    def run(*args, **kwargs):
      out = fn(*args, **kwargs)
      clock[0] += seconds
      return out
    return run

  monkeypatch.setattr(planning, "planner_cluster", advancing(planning.planner_cluster, 0.25))
  monkeypatch.setattr(planning, "plan", advancing(planning.plan, 1.5))
  rows = overhead.measure(profiles.gpu_h100(0.03), sizes=(64,), steps=10)
  (row,) = rows
  planner = row["planner"]
  assert planner["cluster_s"] == 0.25 and planner["seconds"] == 1.5
  assert np.prod(planner["mesh"]) == 64 and sum(planner["stage_layers"]) == 32
  assert row["devices"] == 64 and row["processes"] == 8
  assert row["decide_ms_per_step"] * 10 == pytest.approx(row["decide_ms"] * row["decisions"])
  cells = table_cells(rows)
  assert len(cells) == 12
  assert cells["devices"] == "64" and cells["processes"] == "8"
  assert int(cells["bytes per process per sample"].replace(",", "")) == row["sample_bytes"]
  share = row["decide_ms_per_step"] / 1e3 / row["step_s"]
  assert float(cells["decide / step time"].rstrip("%")) == pytest.approx(100 * share, abs=0.006)
  assert float(cells["decide ms (one stage)"]) == pytest.approx(row["decide_ms"], abs=0.006)
  assert cells["planner s"] == "1.50" and cells["planner's cluster s"] == "0.25"
  assert [int(x) for x in cells["planned mesh d x p x t"].split(" x ")] == planner["mesh"]
  skipped = overhead.measure(profiles.gpu_h100(0.03), sizes=(64,), steps=10, planner_max=32)
  cells = table_cells(skipped)
  assert skipped[0]["planner"] is None
  assert [cells["planner s"], cells["planner's cluster s"]] == ["not run", "–"]
