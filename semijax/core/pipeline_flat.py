"""A pipelined logical state and the unpipelined model's form of it, both ways, without any
device holding a layer its stage does not hold.

The unpipelined ("flat") form keeps each block apart, `encoder.blocks` {l: block l}, as an
unpipelined `Engine`'s logical state and checkpoints do; the pipelined logical form stacks them,
[stages * R, ...] rows over `pipe` (R = ceil(L / stages); stage s holds layers [s R, (s + 1) R),
then zero rows: `core.pipeline`'s doc). Every parameter-shaped part of an optimizer state (Adam's
moments) moves like the parameters.

  * `unstacked`: a one-stage logical state -> the flat form (an unpipelined run resuming a
    pipelined checkpoint).
  * `flat_abstract` -> `stacked`: the flat form with each block placed on its own stage's devices
    (a pipelined run restores an unpipelined checkpoint into it, layer by layer) -> the logical
    state: each stage stacks its layers on its own devices, and the stages' pieces become one
    array over `pipe` where they are (nothing moves between stages).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import mesh as mesh_lib
from semijax.core import pipeline_model
from semijax.core.engine import TrainState
from semijax.core.pipeline_state import PipeStates

SHARED, STACK = pipeline_model.SHARED, pipeline_model.STACK


def _is_params(x) -> bool:
  """A pipelined parameter-shaped tree: {SHARED: ..., STACK: ...}."""
  return isinstance(x, dict) and set(x) == {SHARED, STACK}


def _map_params(fn, tree):
  """`fn` on each pipelined parameter-shaped subtree of `tree`, the other leaves kept."""
  return jax.tree.map(lambda x: fn(x) if _is_params(x) else x, tree, is_leaf=_is_params)


def unstacked(states: PipeStates, logical, shardings: TrainState):
  """A logical `TrainState` of one stage holding every layer ([L, ...] rows: `pipe` 1) in the
  flat form, placed with `shardings` (an `Engine.logical_shardings()` over the same devices and
  tensor count): row l of every stacked parameter and moment is block l."""
  if states.stages != 1:
    raise ValueError(f"unstacked: the engine has {states.stages} stages, not 1")
  num_layers = states.model.num_layers
  flat = _map_params(lambda t: pipeline_model.with_blocks(
      t[SHARED], num_layers, lambda l: jax.tree.map(lambda x: x[l], t[STACK])), logical)
  return jax.device_put(flat, shardings)


def stage_meshes(states: PipeStates) -> list[jax.sharding.Mesh]:
  """Each stage's (data, tensor) devices, as they sit in the pipeline mesh."""
  mesh = states.mesh
  return [jax.sharding.Mesh(mesh.devices[:, s, :], mesh_lib.AXES,
                            axis_types=(jax.sharding.AxisType.Auto,) * 2)
          for s in range(states.stages)]


def _row_spec(spec: P) -> P:
  """A stacked leaf's spec ("pipe" first) for one of its rows on a stage's (data, tensor)
  mesh."""
  return P(*tuple(spec)[1:])


def _is_local(mesh: jax.sharding.Mesh) -> bool:
  return any(d.process_index == jax.process_index() for d in mesh.devices.flat)


def flat_abstract(states: PipeStates, elsewhere: Any = None) -> TrainState:
  """The abstract logical state in the flat form: block l's leaves (the shape of one stacked
  row, [...]) placed on stage l // R's devices, everything else as the logical state places it.
  With `elsewhere` set, the leaves of blocks whose stage has no device of this process are
  `elsewhere` instead (a restore's "skip this leaf": the stage's own processes read them)."""
  abstract, meshes = states.abstract_logical(), stage_meshes(states)
  num_layers = states.model.num_layers

  def flat(tree):
    rows = jax.tree.leaves(tree[STACK])[0].shape[0] // states.stages

    def block(l):
      mesh = meshes[l // rows]
      if elsewhere is not None and not _is_local(mesh):
        return jax.tree.map(lambda x: elsewhere, tree[STACK])
      return jax.tree.map(lambda x: jax.ShapeDtypeStruct(
          x.shape[1:], x.dtype, sharding=NamedSharding(mesh, _row_spec(x.sharding.spec))),
          tree[STACK])
    return pipeline_model.with_blocks(tree[SHARED], num_layers, block)
  return _map_params(flat, abstract)


def _stack_program(count: int, rows: int, shape: tuple, dtype, sharding: NamedSharding):
  """jit: `count` arrays [*shape] -> [rows, *shape] (zero rows after them), placed by
  `sharding` (one stage's mesh)."""
  def stack(*xs):
    head = jnp.stack([x.astype(dtype) for x in xs]) if xs else jnp.zeros((0,) + shape, dtype)
    return jnp.concatenate([head, jnp.zeros((rows - count,) + shape, dtype)])
  return jax.jit(stack, out_shardings=sharding)


def stacked(states: PipeStates, flat, donate: bool = False) -> TrainState:
  """The logical state of a flat one placed as `flat_abstract` says: stage s stacks its layers'
  rows [s R, (s + 1) R) (zeros past the last layer) on its devices, and the stages' pieces are
  joined into arrays [stages R, ...] split over `pipe` without a copy; the other leaves are put
  where the logical state has them. Over several processes each stacks the stages it has
  devices in (the blocks of the others are not read). With `donate`, each block's arrays are
  freed as soon as their rows are stacked: a device then holds its stage's layers once, plus
  one stacked leaf, where keeping `flat` would hold them twice by the end."""
  meshes, abstract = stage_meshes(states), states.abstract_logical()
  num_layers = states.model.num_layers
  program = functools.cache(_stack_program)     # leaves of one shape share a program
  put = lambda tree, like: jax.device_put(tree, jax.tree.map(lambda a: a.sharding, like))

  def join(x, *blocks):
    rows = x.shape[0] // states.stages
    pieces = []
    for s, mesh in enumerate(meshes):
      if not _is_local(mesh):
        continue                      # another process's stage: it stacks its own rows
      mine = blocks[s * rows:min(num_layers, (s + 1) * rows)]
      pieces.append(program(len(mine), rows, tuple(x.shape[1:]), x.dtype,
                            NamedSharding(mesh, P(None, *_row_spec(x.sharding.spec))))(*mine))
      if donate:
        jax.block_until_ready(pieces[-1])
        for block in mine:
          block.delete()
    shards = [shard.data for piece in pieces for shard in piece.addressable_shards]
    return jax.make_array_from_single_device_arrays(x.shape, x.sharding, shards)

  def stack(like, flat_tree):
    blocks = [flat_tree["encoder"]["blocks"][l] for l in range(num_layers)]
    return {SHARED: put(pipeline_model.without_blocks(flat_tree), like[SHARED]),
            STACK: jax.tree.map(join, like[STACK], *blocks)}
  # The abstract state leads: the flat state's parameter subtrees have another structure.
  return jax.tree.map(lambda a, f: stack(a, f) if _is_params(a) else put(f, a),
                      abstract, flat, is_leaf=_is_params)
