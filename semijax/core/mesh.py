"""The device mesh: a `data` axis (batch parallelism) beside a `tensor` axis (uneven TP), and,
for pipelined runs, a `pipe` axis (stages) between them.

Axes are ordered by communication intensity: `tensor` (several all-reduces per layer) is the
inner, fastest-varying axis, so a tensor group sits on neighbouring devices, inside one host or
slice (`topology.device_grid`); stage boundaries (`pipe`) carry activations only; `data`
replicas all-reduce gradients once a step.
Runs without a pipeline use the (data, tensor) mesh; pipelined ones (data, pipe, tensor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from semijax.core import topology

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
  """A (data, tensor) mesh over the first data*tensor of `devices` in their order, or by
  default of all processes' devices placed by the topology (`topology.device_grid`: a tensor
  group inside a host or slice).

  Axis types are Auto: semijax places arrays with explicit NamedShardings and runs TP code in
  `jax.shard_map`, so it needs no sharding-in-types.

  Raises:
    ValueError: naming `mesh.data` / `mesh.tensor` if the sizes are not positive or there are not
      enough devices.
  """
  for name, size in ((DATA, data), (TENSOR, tensor)):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"mesh.{name}: must be a positive integer, got {size!r}")
  available = len(jax.devices() if devices is None else devices)
  if data * tensor > available:
    raise ValueError(
        f"mesh.data * mesh.tensor = {data} * {tensor} = {data * tensor} devices, but only "
        f"{available} are available")
  return jax.sharding.Mesh(_grid((data, tensor), devices), AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * 2)


def make_pipeline_mesh(data: int, pipe: int, tensor: int, devices=None) -> jax.sharding.Mesh:
  """A (data, pipe, tensor) mesh over the first data*pipe*tensor of `devices`, in order (mesh
  position (d, p, t) is device d*pipe*tensor + p*tensor + t of the list: a plan's placement),
  or by default of all processes' devices placed by the topology (`topology.device_grid`).

  Raises:
    ValueError: naming `mesh.data` / `mesh.pipe` / `mesh.tensor` if a size is not a positive
      integer or there are not enough devices.
  """
  for name, size in ((DATA, data), (PIPE, pipe), (TENSOR, tensor)):
    if not isinstance(size, (int, np.integer)) or size < 1:
      raise ValueError(f"mesh.{name}: must be a positive integer, got {size!r}")
  available = len(jax.devices() if devices is None else devices)
  if data * pipe * tensor > available:
    raise ValueError(f"mesh.data * mesh.pipe * mesh.tensor = {data} * {pipe} * {tensor} devices, "
                     f"but only {available} are available")
  return jax.sharding.Mesh(_grid((data, pipe, tensor), devices), PIPELINE_AXES,
                           axis_types=(jax.sharding.AxisType.Auto,) * 3)


def _grid(shape: tuple[int, ...], devices) -> np.ndarray:
  """The devices of a mesh of `shape`: the first of `devices` in order, or by default the
  job's placed by the topology."""
  if devices is None:
    return topology.device_grid(shape, jax.devices())
  return np.asarray(list(devices)[: math.prod(shape)], dtype=object).reshape(shape)


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


def lowering_scope(mesh: jax.sharding.Mesh):
  """The context in which semijax traces and lowers the step programs of `mesh`. Where its
  `tensor` axis has size 1, mesh axes of size 1 are left out of the arrays' types, so a `tensor`
  psum (two per block forward, two backward) is no op at all. Otherwise each lowers to an
  all-reduce over one device, and XLA's simplifier drops only cross-replica all-reduces, not
  shard_map's global-id ones: a 2-layer step lowered 48, of which XLA:CPU kept 7, each a
  kernel launch and a fusion boundary on a GPU.

  With a `tensor` axis of size > 1 it changes nothing: only a one-replica `data` axis could go
  there (one all-reduce of the gradients a step), and dropping it made the even bfloat16 step on
  8 fake CPU devices 1.2-1.4x slower in the peer benchmark (1.68-1.88x plain JAX against
  1.33-1.36x), for reasons in XLA:CPU's scheduling not pinned down."""
  if mesh.shape[TENSOR] > 1:
    return contextlib.nullcontext()
  return jax.remove_size_one_mesh_axis_from_type(True)


def varying_axes(x) -> frozenset:
  """Inside shard_map: the mesh axes over which `x` is typed as varying (check_vma)."""
  aval = jax.typeof(x)
  vma = getattr(aval, "vma", None)            # jax >= 0.11; 0.10 keeps it in aval.mat.varying
  if vma is None:
    vma = getattr(getattr(aval, "mat", None), "varying", frozenset())
  return frozenset(vma)


def vary(x, axes) -> jax.Array:
  """`x` typed as varying over the mesh axes `axes`, casting only over those it lacks."""
  missing = tuple(a for a in axes if a not in varying_axes(x))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def vary_alike(tree, axes=()):
  """Every array of `tree` typed as varying over the union of the axes any of them varies over
  and `axes`: the operands of a `lax.cond` whose predicate varies, cast outside it (an implicit
  cast inside a branch puts its transpose, an all-reduce, inside that branch only, and devices
  that take the other branch never join it)."""
  order = _alike_axes(tree, axes)
  return jax.tree.map(lambda a: vary(a, order), tree)


def _alike_axes(tree, axes) -> tuple:
  """The union of `axes` and the axes any array of `tree` varies over, in the mesh's order."""
  union = frozenset(axes).union(*(varying_axes(a) for a in jax.tree.leaves(tree)))
  return tuple(a for a in PIPELINE_AXES if a in union) + tuple(sorted(union - set(PIPELINE_AXES)))


def cond_or_zeros(here: jax.Array, fn, *operands):
  """`fn(*operands)` where `here` (bool [], varying over `tensor`) holds, zeros of its shapes
  elsewhere, in a `lax.cond`. The operands are cast outside the cond to vary alike over `tensor`
  and whatever they vary over (`vary_alike`), so the transposes of the casts, all-reduces, stay
  outside it too, and both branches return values varying over those axes.

  Returns `fn`'s pytree.
  """
  axes = _alike_axes(operands, (TENSOR,))
  operands = jax.tree.map(lambda a: vary(a, axes), operands)
  run = lambda *a: jax.tree.map(lambda t: vary(t, axes), fn(*a))
  zeros = lambda *a: jax.tree.map(lambda s: vary(jnp.zeros(s.shape, s.dtype), axes),
                                  jax.eval_shape(fn, *a))
  return jax.lax.cond(here, run, zeros, *operands)
