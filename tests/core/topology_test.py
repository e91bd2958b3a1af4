"""Placing meshes on a machine: fake GPU hosts and TPU slices whose device ids do not follow
their hosts, checked for tensor groups inside one host or slice; and the real CPU devices."""

import types

import jax
import numpy as np
import pytest

from semijax.core import mesh as mesh_lib
from semijax.core import topology


def gpus(hosts: int, per_host: int):
  """`hosts` x `per_host` fake GPUs whose ids interleave the hosts (host h holds ids h, h +
  hosts, ...), so id order is not host order."""
  return [types.SimpleNamespace(id=h + hosts * i, process_index=h, platform="gpu",
                                device_kind="NVIDIA H100 80GB HBM3")
          for i in range(per_host) for h in range(hosts)]


def hosts_of(grid, attr="process_index"):
  return np.vectorize(lambda d: getattr(d, attr))(grid)


def test_the_outer_axes_take_the_granules():
  assert topology.split_shape((2, 8), 4) == ((1, 4), (2, 2))      # tensor 8 > a host of 4
  assert topology.split_shape((4, 2, 2), 4) == ((1, 2, 2), (4, 1, 1))
  assert topology.split_shape((2, 2, 4), 4) == ((1, 1, 4), (2, 2, 1))
  assert topology.split_shape((2, 3), 4) is None


@pytest.mark.parametrize("shape", [(2, 4), (4, 2), (2, 2, 2), (1, 2, 4)])
def test_tensor_groups_stay_inside_a_gpu_host(shape):
  devices = gpus(hosts=2, per_host=4)
  grid = topology.device_grid(shape, devices)
  assert grid.shape == shape
  assert sorted(d.id for d in grid.ravel()) == list(range(8))
  groups = hosts_of(grid).reshape(-1, shape[-1])          # a row: one tensor group
  assert all(len(set(row)) == 1 for row in groups), groups
  # In id order (the old reshape) a tensor group of 2 or more straddles both hosts.
  in_id_order = hosts_of(np.asarray(sorted(devices, key=lambda d: d.id)).reshape(shape))
  assert any(len(set(row)) > 1 for row in in_id_order.reshape(-1, shape[-1]))


def test_a_tensor_group_larger_than_a_host_spans_the_fewest_hosts():
  grid = topology.device_grid((2, 8), gpus(hosts=4, per_host=4))
  assert [sorted(set(row)) for row in hosts_of(grid)] == [[0, 1], [2, 3]]
  # pipe x tensor = 2 x 4 inside a host, data across: each data replica is a host pair.
  grid = topology.device_grid((2, 2, 4), gpus(hosts=4, per_host=4))
  assert [sorted(set(hosts_of(grid)[d].ravel())) for d in range(2)] == [[0, 1], [2, 3]]
  assert all(len(set(row)) == 1 for row in hosts_of(grid).reshape(-1, 4))


def test_tpu_slices_are_the_granules_not_their_hosts():
  # 2 slices of 2 hosts x 2 chips (a 2x2 torus each): a tensor group of 4 fills a slice
  # across its two hosts.
  devices = [types.SimpleNamespace(id=i, process_index=i // 2, slice_index=i // 4,
                                   coords=(i % 2, (i // 2) % 2, 0), core_on_chip=0,
                                   platform="tpu", device_kind="fake TPU") for i in range(8)]
  assert topology.granule_attr(devices) == "slice_index"
  grid = topology.device_grid((2, 4), devices)
  assert [sorted(set(row)) for row in hosts_of(grid, "slice_index")] == [[0], [1]]
  assert [sorted(set(row)) for row in hosts_of(grid)] == [[0, 1], [2, 3]]
  assert topology.granule_attr(gpus(2, 2)) == "process_index"


def test_unequal_granules_keep_the_given_order():
  grid = topology.device_grid((1, 6), gpus(hosts=2, per_host=4))   # 3 of each host's 4
  assert [d.id for d in grid.ravel()] == [0, 2, 4, 1, 3, 5]          # host by host
  devices = sorted(gpus(hosts=2, per_host=4), key=lambda d: d.process_index)
  grid = topology.device_grid((2, 3), devices)         # 6 of 8: host 0's 4 and 2 of host 1
  assert [d.id for d in grid.ravel()] == [d.id for d in devices[:6]]


def test_the_cpu_mesh_is_the_devices_in_order():
  mesh = mesh_lib.make_mesh(2, 4)
  assert [d.id for d in mesh.devices.ravel()] == [d.id for d in jax.devices()[:8]]
  assert mesh.axis_names == ("data", "tensor")
  given = jax.devices()[::-1][:4]
  mesh = mesh_lib.make_pipeline_mesh(1, 2, 2, given)
  assert list(mesh.devices.ravel()) == given        # a plan's placement is kept
