"""The device mesh: a `data` axis (batch parallelism) beside a `tensor` axis (uneven TP), and,
for pipelined runs, a `pipe` axis (stages) between them.

Axes are ordered by communication intensity: `tensor` (several all-reduces per layer) is the
inner, fastest-varying axis, so a tensor group sits on neighbouring devices (one host); stage
boundaries (`pipe`) carry activations only; `data` replicas all-reduce gradients once a step.
Runs without a pipeline use the (data, tensor) mesh; pipelined ones (data, pipe, tensor).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

DATA = "data"
PIPE = "pipe"
TENSOR = "tensor"
AXES = (DATA, TENSOR)
PIPELINE_AXES = (DATA, PIPE, TENSOR)


@dataclasses.dataclass(frozen=True)
class MeshSpec:
  """Devices per mesh axis (`config.mesh`)."""

  data: int = 1
  tensor: int = 1
  pipe: int = 1

  @property
  def size(self) -> int:
    return self.data * self.pipe * self.tensor

  def make(self, devices=None) -> jax.sharding.Mesh:
    """The (data, tensor) mesh, or the (data, pipe, tensor) one when `pipe` > 1."""
    if self.pipe > 1:
      return make_pipeline_mesh(self.data, self.pipe, self.tensor, devices)
    return make_mesh(self.data, self.tensor, devices)


def make_mesh(data: int, tensor: int, devices=None) -> jax.sharding.Mesh:
  """A (data, tensor) mesh over the first data*tensor devices (all processes' devices).

  Axis types are Auto: semijax places arrays with explicit NamedShardings and runs TP code in
  `jax.shard_map`, so it needs no sharding-in-types.

  Raises:
    ValueError: naming `mesh.data` / `mesh.tensor` if the sizes are not positive or there are not
      enough devices.
  """
  for name, size in ((DATA, data), (TENSOR, tensor)):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"mesh.{name}: must be a positive integer, got {size!r}")
  devices = jax.devices() if devices is None else list(devices)
  if data * tensor > len(devices):
    raise ValueError(
        f"mesh.data * mesh.tensor = {data} * {tensor} = {data * tensor} devices, but only "
        f"{len(devices)} are available")
  return jax.make_mesh((data, tensor), AXES, devices=devices[: data * tensor],
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_pipeline_mesh(data: int, pipe: int, tensor: int, devices=None) -> jax.sharding.Mesh:
  """A (data, pipe, tensor) mesh over the first data*pipe*tensor of `devices` (default: all),
  in order: mesh position (d, p, t) is device d*pipe*tensor + p*tensor + t of the list.

  Raises:
    ValueError: naming `mesh.data` / `mesh.pipe` / `mesh.tensor` if a size is not a positive
      integer or there are not enough devices.
  """
  for name, size in ((DATA, data), (PIPE, pipe), (TENSOR, tensor)):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"mesh.{name}: must be a positive integer, got {size!r}")
  devices = jax.devices() if devices is None else list(devices)
  if data * pipe * tensor > len(devices):
    raise ValueError(f"mesh.data * mesh.pipe * mesh.tensor = {data} * {pipe} * {tensor} devices, "
                     f"but only {len(devices)} are available")
  grid = np.asarray(devices[: data * pipe * tensor], dtype=object).reshape(data, pipe, tensor)
  return jax.sharding.Mesh(grid, PIPELINE_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)


def batch_feed(mesh: jax.sharding.Mesh) -> tuple[int, int]:
  """(i, n): this process feeds row block i of n equal blocks of every global batch.

  Processes whose devices hold the same `data` indices feed the same rows: with data = 1 and a
  tensor axis across processes, every process feeds the whole batch; with one data replica per
  process, each feeds its own block.

  Raises:
    ValueError: if the processes' data indices do not split the `data` axis into equal blocks.
  """
  devices = np.asarray(mesh.devices)      # [data, (pipe,) tensor]
  rows = {}
  for r in range(devices.shape[0]):
    for d in devices[r].reshape(-1):
      rows.setdefault(d.process_index, set()).add(r)
  blocks = sorted({tuple(sorted(v)) for v in rows.values()})
  if len({len(b) for b in blocks}) != 1 or len({r for b in blocks for r in b}) != sum(
      len(b) for b in blocks):
    raise ValueError(f"mesh: processes hold data indices {blocks}, not equal disjoint blocks")
  return blocks.index(tuple(sorted(rows[jax.process_index()]))), len(blocks)


def put(x, mesh: jax.sharding.Mesh, spec: jax.sharding.PartitionSpec) -> jax.Array:
  """The host array `x`, identical on every process, as a global array placed with `spec` on
  `mesh` (each device gets its block). Unlike `jax.device_put`, which checks across processes
  that a host array is equal everywhere (one collective per array: about 3 ms on two CPU
  processes, paid by every index array of a plan or migration), this trusts the caller: plans
  are built from the same layout on every process."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, jax.sharding.NamedSharding(mesh, spec),
                                      lambda index: x[index])
