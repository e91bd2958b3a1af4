"""The tensor-parallel engine: padded state, sharded steps, one compiled variant per bucket.

An `Engine` holds one model definition (an NNX graphdef with logical parameter shapes), a
(data, tensor) mesh and an optax optimizer. It

  * initializes parameters in logical form from a seed (so every layout starts from the same
    model) and packs them into padded device-major arrays for a `Layout` (`engine_state`, mixed
    in);
  * builds the loss under `jax.shard_map` (batch split over `data`, units over `tensor`) and the
    pure train step `(state, batch, plan) -> (state, metrics)` (`engine_steps`);
  * compiles that step ahead of time per layout *bucket* (capacities and compute widths). Owned
    counts and active widths are data (`plan_lib.Plan`), so changing them inside a bucket reuses the
    compiled step; `compile_count` counts the XLA compilations the engine asked for
    (`engine_programs`).
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import engine_programs
from semijax.core import engine_state
from semijax.core import engine_steps
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib
from semijax.core import precision as precision_lib
from semijax.core import remat
from semijax.core import sharding
from semijax.core import width_gemm

TrainState = engine_state.TrainState


class Engine(engine_state.StateForms):
  """Runs one model with uneven tensor parallelism on one mesh (see module doc).

  Args:
    model_fn: rngs -> nnx.Module with `__call__(inputs, plan)`, `input_key` and `unit_sizes()`.
    loss_terms: (logits, batch) -> {"loss_sum", "count", "correct"} local sums (`tasks`).
    mesh: a (data, tensor) mesh from `mesh.make_mesh`.
    tx: the optax optimizer (applied to padded parameters; padded slots stay zero).
    strict: if True, a step for a bucket that was not compiled raises instead of compiling.
    kernel: how a device computes its width of a block (`layout.kernel`, `Plan.kernel`):
      "switch", "pallas" or "auto" (pallas on GPU and TPU).
    accumulation: microbatches a train step runs in sequence before its one update
      (`gradient_accumulation_steps`; `engine_steps.StepFunctions`).

  The state's forms and moves (`init`, `init_logical`, `to_padded`, `to_logical`, `move`, ...)
  are mixed in from `engine_state.StateForms`; the traceable loss and steps are `steps`
  (`engine_steps.StepFunctions`) and their compiled variants `programs`
  (`engine_programs.StepPrograms`), which the methods below call.
  """

  def __init__(self, model_fn: Callable[[nnx.Rngs], nnx.Module], loss_terms: Callable,
               mesh: jax.sharding.Mesh, tx: optax.GradientTransformation, *,
               strict: bool = False, kernel: str = "auto", accumulation: int = 1):
    width_gemm.resolve(kernel)               # names layout.kernel when it is not one of them
    self.kernel = kernel
    abstract = nnx.eval_shape(lambda: model_fn(nnx.Rngs(0)))
    self.graphdef, abstract_state = nnx.split(abstract)
    bad = [jax.tree_util.keystr(p) for p, v in jax.tree_util.tree_leaves_with_path(
        abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
           if not isinstance(v, nnx.Param)]
    if bad:
      raise ValueError(f"the engine trains nnx.Param only; found other variables at {bad}")
    self.model_fn, self.loss_terms, self.mesh, self.tx = model_fn, loss_terms, mesh, tx
    self.axes = sharding.axes_tree(abstract_state)
    self.logical_shapes = jax.tree.map(lambda v: v.shape, nnx.to_pure_dict(abstract_state))
    self.input_key = abstract.input_key
    self.precision = getattr(abstract, "precision", precision_lib.Precision())
    remat.check(self.precision.remat_policy, kernel)
    self.unit_sizes = abstract.unit_sizes()
    self.num_units = self._num_units()
    blocks = [sharding.block_index(path) for path, _ in
              jax.tree_util.tree_leaves_with_path(self.axes)]
    self.num_layers = 1 + max((b for b in blocks if b is not None), default=0)
    self.param_shardings = sharding.shardings(self.axes, mesh)
    self.replicated = NamedSharding(mesh, P())
    self.batch_sharding = NamedSharding(mesh, P(mesh_lib.DATA))
    self.feeds = mesh_lib.batch_feed(mesh)[1]     # row blocks the processes feed
    # Compiled programs of the balancing helpers (the resize priority's scores), kept with the
    # engine so that runs which reuse it (benchmarks) reuse them too.
    self.helper_programs: dict = {}
    self.steps = engine_steps.StepFunctions(self.graphdef, loss_terms, self.input_key, self.axes,
                                            self.unit_sizes, mesh, tx, accumulation)
    self.programs = engine_programs.StepPrograms(
        self.steps.train_step, self.steps.eval_step, self.state_shardings, self.replicated, mesh,
        strict=strict)

  # --- layouts --------------------------------------------------------------------------------

  def _num_units(self) -> dict:
    out = {}
    for a, shape in zip(jax.tree.leaves(self.axes), jax.tree.leaves(
        self.logical_shapes, is_leaf=lambda x: isinstance(x, tuple))):
      if (unit := a.unit()) is not None:
        axis, kind = unit
        out[kind] = shape[axis] // self.unit_sizes[kind]
    return out

  def unit_bytes(self) -> dict:
    """{kind: bytes of one unit's weights over all layers, in the compute dtype: what a block
    reads, and what offloading a unit sends every step}."""
    out = {}
    for a, shape in zip(jax.tree.leaves(self.axes), jax.tree.leaves(
        self.logical_shapes, is_leaf=lambda x: isinstance(x, tuple))):
      if (unit := a.unit()) is not None:
        kind = unit[1]
        out[kind] = out.get(kind, 0.0) + (self.precision.compute_bytes * np.prod(shape)
                                          / self.num_units[kind])
    return out

  @property
  def tensor_size(self) -> int:
    return self.mesh.shape[mesh_lib.TENSOR]

  @property
  def data_size(self) -> int:
    return self.mesh.shape[mesh_lib.DATA]

  def check_layout(self, layout: layout_lib.Layout) -> None:
    """Raises LayoutError unless `layout` fits this model and mesh."""
    if layout.num_devices != self.tensor_size:
      raise layout_lib.LayoutError(
          f"layout: {layout.num_devices} devices, but mesh.tensor = {self.tensor_size}")
    for kind, u in layout.kinds().items():
      if u.num_units != self.num_units[kind]:
        raise layout_lib.LayoutError(
            f"layout.{kind}: {u.num_units} units, but the model has {self.num_units[kind]}")

  def plan(self, layout: layout_lib.Layout, resize=None, offload=None,
           widths=None) -> plan_lib.Plan:
    """The device-placed plan for a step with `layout`.

    Args:
      layout: the layout the state is packed in.
      resize: optional host `resize.Resize` (from `priority.Priority.select`).
      offload: optional {kind: {straggler: {helper: units}}} (`offload.for_target` builds one):
        helpers compute those units of the straggler every step, exactly. Every amount (and {})
        shares one compiled step per bucket; None is the plain path (another compiled step).
        Not combinable with `resize` (ValueError naming `offload`).
      widths: optional {kind: compute widths} narrowing the compiled branches
        (`plan_lib.uniform_widths`); another compiled step.
    """
    self.check_layout(layout)
    return plan_lib.make_plan(layout, self.mesh, resize=resize, offload=offload, widths=widths,
                              kernel=self.kernel)

  # --- sharded computation (`engine_steps.StepFunctions`) -------------------------------------

  def shard_batch(self, batch: dict) -> dict:
    """Host arrays (this process's rows of the global batch, `mesh.batch_feed`) -> arrays split
    over `data`."""
    def one(x):
      x = np.asarray(x)
      global_shape = (x.shape[0] * self.feeds,) + x.shape[1:]
      return jax.make_array_from_process_local_data(self.batch_sharding, x, global_shape)
    return jax.tree.map(one, batch)

  def loss_terms_fn(self, params, batch, plan) -> dict:
    """Global {"loss_sum", "count", "correct"} of padded `params` on a sharded batch."""
    return self.steps.loss_terms_fn(params, batch, plan)

  def loss(self, params, batch, plan):
    """Mean loss over the global batch, and the summed terms."""
    return self.steps.loss(params, batch, plan)

  def replica_grads_and_terms(self, stacked_params, batch, plan, scale=None):
    """Each data replica's gradients on its own parameters [R, *P] (times its loss scale
    `scale` [R] where given), and its loss terms {name: [R]}
    (`engine_steps.StepFunctions.replica_grads_and_terms`)."""
    return self.steps.replica_grads_and_terms(stacked_params, batch, plan, scale)

  def logits(self, params, batch, plan) -> jax.Array:
    """Logits [global batch, ...] (batch split over data), for tests and inspection."""
    return self.steps.logits(params, batch, plan)

  @property
  def trace_count(self) -> int:
    """How many times the train and eval steps were traced."""
    return self.steps.trace_count

  # --- compiled variants (`engine_programs.StepPrograms`) -------------------------------------

  def compile(self, state: TrainState, batch, plan: plan_lib.Plan, eval_batch=None) -> None:
    """Compiles (ahead of time) the train and eval steps for this state/batch/plan bucket."""
    self.programs.compile(state, batch, plan, eval_batch)

  def exercise(self, state: TrainState, batch, plan: plan_lib.Plan) -> None:
    """Runs every branch of `plan`'s compiled train step once on a throwaway copy of `state`
    (`engine_programs.StepPrograms.exercise`: on CPU; elsewhere it compiles only); once per
    compiled step, `state` left as it is."""
    self.programs.exercise(state, batch, plan)

  def train_step(self, state: TrainState, batch, plan: plan_lib.Plan):
    """One optimizer step; `state` is donated. Returns (new state, metrics dict of scalars)."""
    return self.programs.train_step(state, batch, plan)

  def eval_terms(self, params, batch, plan: plan_lib.Plan) -> dict:
    """Summed loss terms of one evaluation batch; evaluation is exact (`plan.resize` ignored,
    `plan.offload` kept: it is exact)."""
    return self.programs.eval_terms(params, batch, plan)

  def _compiled_fn(self, kind, state_or_params, batch, plan):
    # benchmarks/breakdown reads the compiled train step's HLO.
    return self.programs.compiled_fn(kind, state_or_params, batch, plan)

  @property
  def compile_count(self) -> int:
    """How many XLA compilations of a step the engine asked for."""
    return self.programs.compile_count

  @property
  def strict(self) -> bool:
    """Whether a step for a bucket that was not compiled raises instead of compiling."""
    return self.programs.strict
