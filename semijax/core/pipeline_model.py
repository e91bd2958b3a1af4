"""A model as a pipeline holds it (`PipeModel`): its graph split into the shared parameters
(embeddings, final norm, head) and one block's, their logical axes, its sizes, and the model
that runs the shared parameters alone. `core.pipeline` has the design (see its module doc).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from semijax.core import layout as layout_lib
from semijax.core import sharding

LAYERS = layout_lib.LAYERS
SHARED, STACK = "shared", "stack"      # the two subtrees of pipelined parameters (`core.pipeline`)


def without_blocks(tree: dict) -> dict:
  """`tree` (the model's state or axes) without its `encoder.blocks` subtree."""
  out = dict(tree)
  out["encoder"] = {k: v for k, v in tree["encoder"].items() if k != "blocks"}
  return out


def with_blocks(shared: dict, num_layers: int, block: Callable[[int], Any]) -> dict:
  """`shared` (the model's state without its blocks) with `encoder.blocks` {l: block(l)} for
  l < num_layers: the inverse of `without_blocks` (new dicts; `shared` is left as it is)."""
  out = dict(shared)
  out["encoder"] = dict(shared["encoder"], blocks={l: block(l) for l in range(num_layers)})
  return out


def stack_axes(a: sharding.Axes) -> sharding.Axes:
  """A block parameter's axes with the leading "layers" axis of the stacked form."""
  return sharding.Axes((LAYERS,) + tuple(a.names))


@dataclasses.dataclass(frozen=True)
class PipeModel:
  """One model's parts as the pipeline holds them (built from its abstract state: no weights).

  Attributes:
    model_fn: rngs -> nnx.Module (see `pipeline.PipelineEngine`).
    graphdef: the whole model's graph.
    block_graphdef: one block's graph (every block has the same).
    block_axes: one block's parameter axes (`sharding.Axes` tree).
    axes: {SHARED: the model's axes without its blocks, STACK: `block_axes` with a leading
      "layers" axis}: the axes of pipelined parameters.
    num_layers: L, the model's blocks.
    input_key: the batch key the stem reads.
    unit_sizes: {kind: columns of one unit}.
    num_units: {kind: U, units of that kind in one block}.
    remat_policy: what a stage keeps of each block's activations for its backward pass
      (`core.remat`; the model's `precision.remat_policy`).
  """

  model_fn: Callable[[nnx.Rngs], nnx.Module]
  graphdef: Any
  block_graphdef: Any
  block_axes: Any
  axes: dict
  num_layers: int
  input_key: str
  unit_sizes: dict
  num_units: dict
  remat_policy: str = "none"

  @classmethod
  def of(cls, model_fn: Callable[[nnx.Rngs], nnx.Module]) -> "PipeModel":
    """The parts of `model_fn`'s model, from its abstract state (`nnx.eval_shape`)."""
    abstract = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    block_graphdef = nnx.split(abstract.encoder.blocks[0])[0]
    full_axes = sharding.axes_tree(abstract_state)
    block_axes = full_axes["encoder"]["blocks"][0]
    axes = {SHARED: without_blocks(full_axes), STACK: jax.tree.map(stack_axes, block_axes)}
    unit_sizes = abstract.unit_sizes()
    return cls(model_fn, graphdef, block_graphdef, block_axes, axes,
               len(full_axes["encoder"]["blocks"]), abstract.input_key, unit_sizes,
               _num_units(abstract_state, block_axes, unit_sizes),
               getattr(abstract.encoder, "remat_policy", "none"))

  def shared_model(self, shared):
    """The model with `shared` parameters (its blocks' parameters are placeholders: only
    `stem` and `head_out` run on it)."""
    state = copy.copy(shared)
    state["encoder"] = dict(shared["encoder"])
    dummy = jax.tree.map(lambda _: jnp.zeros(()), self.block_axes)
    state["encoder"]["blocks"] = {i: dummy for i in range(self.num_layers)}
    return nnx.merge(self.graphdef, state)


def _num_units(abstract_state, block_axes, unit_sizes: dict) -> dict:
  """{kind: units of that kind in one block}, from the block's unit axes' lengths."""
  shapes = nnx.to_pure_dict(jax.tree.map(lambda v: v.shape, abstract_state,
                                         is_leaf=lambda x: isinstance(x, nnx.Variable)))
  block = shapes["encoder"]["blocks"][0]
  out = {}
  for a, shape in zip(jax.tree.leaves(block_axes),
                      jax.tree.leaves(block, is_leaf=lambda x: isinstance(x, tuple))):
    if (unit := a.unit()) is not None:
      axis, kind = unit
      out[kind] = shape[axis] // unit_sizes[kind]
  return out
