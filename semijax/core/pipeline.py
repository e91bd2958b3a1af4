"""Pipelined training (PatchPipe's device side): uneven layers per stage on a (data, pipe, tensor)
mesh, microbatched schedules under `jax.shard_map`, exact gradients.

Where the state lives (`PipeLayout`): stage s (a position on `pipe`) holds a contiguous run of
layers, `layers.owned[s]`, in `layers.capacity` slots (more than it owns when stages are uneven;
padded slots are zeros and never run), and inside the stage every block's units follow that
stage's own tensor layout `units[s]` (each stage is a tensor group of its own). Every block
parameter is stacked on a leading layer axis of P x capacity rows (logical axis "layers", split
over `pipe`): params = {"shared": <embeddings, final norm, head: replicated>, "stack": <block
parameters, [P*cap, ...]>}. Data-parallel pipelines (`data`) are replicas of one structure.

The logical (layout-independent) form is the padded form of the canonical `PipeLayout` (layers in
order, ceil(L / P) per stage; units in order in every stage). Packing and unpacking are
migrations (`core.migrate`): first each stage's units between its tensor layout and the
canonical one (over `tensor`), then, if layers change stage, the stacked rows over `pipe`; a
layer boundary moves with the migration collective, weights and Adam moments together.

A step runs a schedule's tick table (`core.schedule`): in a tick each stage runs at most one
forward and one backward (the backward recomputes its forward with `jax.vjp` from the stashed
input), then two ppermutes over `pipe` carry activations forward and cotangents back. Inside a
stage, `lax.scan` runs its layer slots and `lax.cond` skips the slots past its layer count (data:
moving a boundary inside a bucket recompiles nothing), each block being the usual uneven
tensor-parallel block. The first stage also runs the embedding, the last the head and the loss
(normalized by the whole global batch's token count, so gradients equal the unpipelined ones).
Gradients of the shared parameters are summed over `pipe` and every gradient over `data` once,
after the last tick, outside any branch. Data-parallel pipelines may run different numbers of
microbatches (a faster pipeline takes more of the global batch): each replica has its own table,
padded to the longest with idle ticks.

Where each part lives: `pipeline_layout` the layout and the plan of a step, `pipeline_model` the
model's shared and stacked parts, `pipeline_state` the state forms and the moves between them,
`pipeline_flat` the logical state in the unpipelined model's form (blocks apart),
`pipeline_batch` the microbatched batch, `pipeline_step` the tick body, `pipeline_programs` the
sharded, compiled programs; `PipelineEngine` (here) holds them together.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import migrate
from semijax.core import pipeline_batch
from semijax.core import pipeline_flat
from semijax.core import pipeline_layout
from semijax.core import pipeline_model
from semijax.core import pipeline_moves
from semijax.core import pipeline_programs
from semijax.core import pipeline_state
from semijax.core import pipeline_step
from semijax.core import remat
from semijax.core import schedule as schedule_lib
from semijax.core import width_gemm
from semijax.core.engine import TrainState

DATA, PIPE, TENSOR = mesh_lib.DATA, mesh_lib.PIPE, mesh_lib.TENSOR
LAYERS = layout_lib.LAYERS
SHARED, STACK = pipeline_model.SHARED, pipeline_model.STACK
PipeLayout = pipeline_layout.PipeLayout          # the names callers import from here
PipePlan = pipeline_layout.PipePlan


class PipelineEngine:
  """Runs one model pipelined over a (data, pipe, tensor) mesh (see module doc).

  Holds the model's parts (`parts`, a `pipeline_model.PipeModel`), its state forms (`states`, a
  `pipeline_state.PipeStates`), the tick body (`step_body`, a `pipeline_step.PipeStep`) and the
  compiled programs (`programs`, a `pipeline_programs.PipePrograms`); its methods are theirs.

  Args:
    model_fn: rngs -> nnx.Module with `stem(inputs)`, `encoder.blocks`, `encoder.run_blocks`,
      `head_out(x)`, `input_key` and `unit_sizes()` (the models in `semijax.models`).
    loss_terms: (logits, batch) -> {"loss_sum", "count", "correct"} local sums (`models.tasks`).
    mesh: a (data, pipe, tensor) mesh (`mesh.make_pipeline_mesh`).
    tx: the optax optimizer (applied to the stacked parameters; padded rows stay zero).
    schedule: "gpipe" or "1f1b" (`core.schedule`).
    microbatches: the most microbatches any data-parallel pipeline runs in a step (static).
    kernel: how a device computes its width of a block (`layout.kernel`, `Plan.kernel`).
  """

  def __init__(self, model_fn: Callable[[nnx.Rngs], nnx.Module], loss_terms: Callable,
               mesh: jax.sharding.Mesh, tx: optax.GradientTransformation, *,
               schedule: str = "1f1b", microbatches: int = 1, kernel: str = "auto"):
    width_gemm.resolve(kernel)               # names layout.kernel when it is not one of them
    if schedule not in schedule_lib.SCHEDULES:
      raise ValueError(f"pipeline.schedule: {schedule!r} is not one of "
                       f"{list(schedule_lib.SCHEDULES)}")
    self.parts = parts = pipeline_model.PipeModel.of(model_fn)
    remat.check(parts.remat_policy, kernel)
    self.model_fn, self.loss_terms, self.mesh, self.tx = model_fn, loss_terms, mesh, tx
    self.schedule, self.microbatches = schedule, int(microbatches)
    self.graphdef, self.block_graphdef = parts.graphdef, parts.block_graphdef
    self.block_axes, self.axes = parts.block_axes, parts.axes
    self.num_layers, self.input_key = parts.num_layers, parts.input_key
    self.unit_sizes, self.num_units = parts.unit_sizes, parts.num_units
    self.stages, self.tensor_size = mesh.shape[PIPE], mesh.shape[TENSOR]
    self.data_size = mesh.shape[DATA]
    self.states = pipeline_state.PipeStates(parts, mesh, tx)
    self.step_body = pipeline_step.PipeStep(parts, loss_terms, stages=self.stages,
                                            schedule=schedule, microbatches=self.microbatches,
                                            kernel=kernel)
    self.param_shardings = self.states.param_shardings
    self.programs = pipeline_programs.PipePrograms(self.step_body, mesh, self.axes,
                                                   self.param_shardings, tx)
    self.replicated = self.programs.replicated
    self.batch_sharding = NamedSharding(mesh, P(DATA))

  @property
  def compile_count(self) -> int:
    """Step programs (train and eval) compiled so far."""
    return self.programs.compile_count

  # --- layouts ----------------------------------------------------------------------------------

  @property
  def logical_layout(self) -> PipeLayout:
    return self.states.logical_layout

  def check_layout(self, layout: PipeLayout) -> None:
    """Raises LayoutError unless `layout` fits this model and mesh."""
    self.states.check_layout(layout)

  def plan(self, layout: PipeLayout, microbatches: Sequence[int] | None = None) -> PipePlan:
    """The device-placed plan of a step in `layout`; `microbatches`: per data replica (default
    `self.microbatches` each), each at most `self.microbatches`."""
    self.check_layout(layout)
    counts = tuple(microbatches or (self.microbatches,) * self.data_size)
    if len(counts) != self.data_size or not all(1 <= c <= self.microbatches for c in counts):
      raise ValueError(f"pipeline.microbatches: {counts} must give each of the {self.data_size} "
                       f"pipelines between 1 and {self.microbatches} microbatches")
    tables = [schedule_lib.table(self.schedule, self.stages, c) for c in counts]
    longest = len(schedule_lib.table(self.schedule, self.stages, self.microbatches))
    table = np.full((self.data_size, longest, self.stages, 2), -1, np.int32)
    for d, t in enumerate(tables):
      table[d, :len(t)] = t
    put = lambda x, spec: mesh_lib.put(x, self.mesh, spec)
    active = {k: put(np.stack([np.asarray(u.kinds()[k].active, np.int32) for u in layout.units]),
                     P(PIPE, TENSOR)) for k in self.num_units}
    return PipePlan(active, put(np.asarray(layout.stage_layers, np.int32), P(PIPE)),
                    put(table, P(DATA)),
                    tuple((k, u.widths) for k, u in layout.units[0].kinds().items()))

  # --- state forms (`pipeline_state.PipeStates`) ------------------------------------------------

  def logical_shardings(self) -> TrainState:
    return self.states.logical_shardings()

  def init_logical(self, seed: int) -> TrainState:
    """The sharded logical state from `seed`, built under its sharding (no replicated copy)."""
    return self.states.init_logical(seed)

  def abstract_logical(self) -> TrainState:
    return self.states.abstract_logical()

  def local_bytes(self, layout: PipeLayout) -> tuple[float, float]:
    """(block, replicated): parameter bytes one device holds in `layout`."""
    return self.states.local_bytes(layout)

  def tree_axes(self, tree):
    return self.states.tree_axes(tree)

  def migrator(self) -> migrate.Migrator:
    return self.states.migrator()

  def move(self, tree, old: PipeLayout, new: PipeLayout, *, donate: bool = False):
    """A state (or parameter-shaped tree) padded in `old`, padded in `new`."""
    return self.states.move(tree, old, new, donate=donate)

  def compile_moves(self, state, layout: PipeLayout) -> int:
    """Compiles every migration program a move between two layouts of `layout`'s bucket may
    run (`pipeline_moves`); returns how many were new."""
    return pipeline_moves.compile_moves(self.states, state, layout)

  def to_padded(self, logical, layout: PipeLayout, *, donate: bool = False):
    return self.states.to_padded(logical, layout, donate=donate)

  def to_logical(self, padded, layout: PipeLayout, *, donate: bool = False):
    return self.states.to_logical(padded, layout, donate=donate)

  def init(self, seed: int, layout: PipeLayout) -> TrainState:
    return self.states.init(seed, layout)

  def logical_arrays(self, logical) -> Any:
    """Host numpy copies of a logical tree in the unpipelined model's form."""
    return self.states.logical_arrays(logical)

  def unstacked(self, logical, shardings: TrainState):
    """A one-stage engine's logical state in the unpipelined model's form
    (`pipeline_flat.unstacked`)."""
    return pipeline_flat.unstacked(self.states, logical, shardings)

  def flat_abstract(self, elsewhere: Any = None) -> TrainState:
    """The abstract logical state in the unpipelined model's form, each block on its stage's
    devices, or `elsewhere` for another process's stage (`pipeline_flat.flat_abstract`)."""
    return pipeline_flat.flat_abstract(self.states, elsewhere)

  def stacked(self, flat, donate: bool = False) -> TrainState:
    """The logical state of a `flat_abstract`-placed one (`pipeline_flat.stacked`); `donate`
    frees each block of `flat` once stacked."""
    return pipeline_flat.stacked(self.states, flat, donate)

  def state_shardings(self, params_abstract) -> TrainState:
    """Shardings of a padded train state with parameters shaped like `params_abstract`."""
    return self.states.state_shardings(params_abstract)

  # --- batches (`pipeline_batch`) -----------------------------------------------------------------

  def arrange_batch(self, batch: dict, microbatches: Sequence[int]) -> dict:
    """Host arrays of the global batch (sum(microbatches) * microbatch rows, in order) -> arrays
    [data * M * microbatch, ...] split over `data`: replica d gets its `microbatches[d]`
    microbatches, the rest zeros with weight 0 (M = `self.microbatches`)."""
    return pipeline_batch.arrange(batch, microbatches, most=self.microbatches,
                                  batch_sharding=self.batch_sharding)

  def shard_batch(self, batch: dict) -> dict:
    """`arrange_batch` with `self.microbatches` microbatches for every pipeline (the replica
    modes: pipeline d takes rows [d B / R, (d + 1) B / R) of the global batch)."""
    return self.arrange_batch(batch, (self.microbatches,) * self.data_size)

  # --- the sharded step (`pipeline_programs.PipePrograms`) ----------------------------------------

  def replica_grads_and_terms(self, stacked_params, batch, pplan, scale=None):
    """Each data-parallel pipeline's own gradients, on its own parameters: stacked_params
    [R, *P] -> (gradients [R, *P], times its loss scale `scale` [R] where given; loss terms
    {name: [R]}); nothing summed over `data`."""
    return self.programs.replica_grads_and_terms(stacked_params, batch, pplan, scale)

  def grads_and_terms(self, params, batch, pplan):
    """(gradients like `params`, summed loss terms) of one step's global batch."""
    return self.programs.grads_and_terms(params, batch, pplan)

  def compile(self, state: TrainState, batch, pplan: PipePlan, eval_batch=None) -> None:
    self.programs.compile(state, batch, pplan, eval_batch)

  def train_step(self, state: TrainState, batch, pplan: PipePlan):
    """One optimizer step; `state` is donated. Returns (new state, metrics dict of scalars)."""
    return self.programs.train_step(state, batch, pplan)

  def eval_terms(self, params, batch, pplan: PipePlan) -> dict:
    return self.programs.eval_terms(params, batch, pplan)
