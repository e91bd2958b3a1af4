"""Placing a mesh on the machine: the inner axes inside a host or slice, the outer ones across.

A mesh's axes are ordered by communication intensity, the last (`tensor`: several all-reduces a
layer) the most intense. Devices are grouped into *granules* joined by the slower network: TPU
slices (`slice_index`, over DCN) where the devices have them, else processes (one per host on
GPU clusters, over the data-center network). `device_grid` gives the mesh's axes to the
granules from the outermost in (`split_shape`), so `data` and `pipe` cross granules and `tensor`
stays inside one unless it is larger than a granule; inside a granule,
`jax.experimental.mesh_utils` orders the devices by the physical topology (a TPU's torus; on
GPUs, device ids). Granules of unequal sizes (a mesh over a part of the job's devices that
splits a granule) fall back to the devices' order, and so do CPU devices, which have no
topology (`jax.devices()` lists them process by process): XLA:CPU runs a collective on a mesh
from mesh_utils' arrays of its devices into a rendezvous that one device never joined
(tests/core/pipeline_test.py's layer move, in both runs tried), and on the same devices in a plainly
built array it does not.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

import numpy as np
from jax.experimental import mesh_utils


def granule_attr(devices: Sequence) -> str:
  """"slice_index" for TPUs that carry slice indices (the hosts of a slice share its ICI),
  else "process_index"."""
  if all(d.platform == "tpu" and getattr(d, "slice_index", None) is not None for d in devices):
    return "slice_index"
  return "process_index"


def split_shape(shape: Sequence[int], granules: int
                ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(per-granule shape, across-granule shape), elementwise products `shape`, with the
  `granules` placed on the outermost axes that take them; None if they do not divide `shape`."""
  inner, outer, left = list(shape), [1] * len(shape), granules
  for i, size in enumerate(shape):
    take = math.gcd(left, size)
    outer[i], inner[i], left = take, size // take, left // take
  return (tuple(inner), tuple(outer)) if left == 1 else None


def device_grid(shape: Sequence[int], devices: Sequence) -> np.ndarray:
  """The first prod(shape) of `devices` as an array [*shape] placed by the topology (see
  module doc)."""
  n = math.prod(shape)
  devices = list(devices)[:n]
  in_order = np.asarray(devices, dtype=object).reshape(tuple(shape))
  if devices[0].platform == "cpu":
    return in_order
  attr = granule_attr(devices)
  groups = collections.Counter(getattr(d, attr) for d in devices)
  if len(groups) == 1:
    return mesh_utils.create_device_mesh(tuple(shape), devices, allow_split_physical_axes=True)
  split = split_shape(shape, len(groups))
  if split is None or len(set(groups.values())) != 1:
    return in_order
  inner, outer = split
  return mesh_utils.create_hybrid_device_mesh(
      inner, outer, devices, process_is_granule=attr == "process_index",
      allow_split_physical_axes=True)
