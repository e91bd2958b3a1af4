"""The tensor-parallel engine: padded state, sharded steps, one compiled variant per bucket.

An `Engine` holds one model definition (an NNX graphdef with logical parameter shapes), a
(data, tensor) mesh and an optax optimizer. It

  * initializes parameters in logical form from a seed (so every layout starts from the same
    model) and packs them into padded device-major arrays for a `Layout`;
  * builds the loss under `jax.shard_map` (batch split over `data`, units over `tensor`) and the
    pure train step `(state, batch, plan) -> (state, metrics)`;
  * compiles that step ahead of time per layout *bucket* (capacities and compute widths). Owned
    counts and active widths are data (`plan_lib.Plan`), so changing them inside a bucket reuses the
    compiled step; `compile_count` counts the XLA compilations the engine asked for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import migrate
from semijax.core import plan as plan_lib
from semijax.core import precision as precision_lib
from semijax.core import resize as resize_lib
from semijax.core import sharding


@functools.partial(jax.tree_util.register_dataclass, data_fields=("params", "opt_state"),
                   meta_fields=())
@dataclasses.dataclass(frozen=True)
class TrainState:
  """Parameters (pure dict) and optax state; padded or logical depending on context."""

  params: Any
  opt_state: Any


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _signature(tree) -> tuple:
  return tuple((jax.tree_util.keystr(k), tuple(v.shape), str(v.dtype))
               for k, v in jax.tree_util.tree_leaves_with_path(tree))


class Engine:
  """Runs one model with uneven tensor parallelism on one mesh (see module doc).

  Args:
    model_fn: rngs -> nnx.Module with `__call__(inputs, plan)`, `input_key` and `unit_sizes()`.
    loss_terms: (logits, batch) -> {"loss_sum", "count", "correct"} local sums (`tasks`).
    mesh: a (data, tensor) mesh from `mesh.make_mesh`.
    tx: the optax optimizer (applied to padded parameters; padded slots stay zero).
    strict: if True, a step for a bucket that was not compiled raises instead of compiling.
  """

  def __init__(self, model_fn: Callable[[nnx.Rngs], nnx.Module], loss_terms: Callable,
               mesh: jax.sharding.Mesh, tx: optax.GradientTransformation, *,
               strict: bool = False):
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
    self.unit_sizes = abstract.unit_sizes()
    self.num_units = self._num_units()
    blocks = [sharding.block_index(path) for path, _ in
              jax.tree_util.tree_leaves_with_path(self.axes)]
    self.num_layers = 1 + max((b for b in blocks if b is not None), default=0)
    self.strict = strict
    self._exercised: set = set()
    self.param_shardings = sharding.shardings(self.axes, mesh)
    self.replicated = NamedSharding(mesh, P())
    self.batch_sharding = NamedSharding(mesh, P(mesh_lib.DATA))
    self.feeds = mesh_lib.batch_feed(mesh)[1]     # row blocks the processes feed
    self._compiled: dict = {}
    self._init_fn = None
    self._migrator = None
    # Compiled programs of the balancing helpers (the resize priority's scores), kept with the
    # engine so that runs which reuse it (benchmarks) reuse them too.
    self.helper_programs: dict = {}
    self.compile_count = 0
    self.trace_count = 0

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
    return plan_lib.make_plan(layout, self.mesh, resize=resize, offload=offload, widths=widths)

  def migrator(self):
    """This engine's `migrate.Migrator` (one per engine, so its compiled moves are reused)."""
    if self._migrator is None:
      self._migrator = migrate.Migrator.for_engine(self)
    return self._migrator

  # --- parameters and optimizer state ---------------------------------------------------------
  #
  # Two forms of one state, both sharded over `tensor` (no device ever holds all of it):
  #   padded: in a run's layout (`Layout`), what the steps compute on;
  #   logical: in the canonical layout (`Layout.canonical`): every unit axis in logical unit order,
  #     zeros appended up to N*ceil(U/N) units when N does not divide U. It is layout-independent
  #     (checkpoints hold it) and, as a padded form itself, it moves to and from any layout with
  #     the migration collective, group by group (`migrate.Migrator.move_groups`).

  @property
  def logical_layout(self) -> layout_lib.Layout:
    """The canonical layout of the sharded logical form (see above)."""
    return layout_lib.Layout.canonical(self.num_units, self.tensor_size)

  def _init_logical(self, seed) -> TrainState:
    """The logical state from `seed` (an int or a key), unit axes padded to the canonical
    layout's slots."""
    params = nnx.to_pure_dict(nnx.split(self.model_fn(nnx.Rngs(seed)))[1])
    state = TrainState(params, self.tx.init(params))
    slots = {k: u.num_slots * self.unit_sizes[k] for k, u in self.logical_layout.kinds().items()}

    def pad(x, a):
      if (unit := a.unit()) is None:
        return x
      axis, kind = unit
      widths = [(0, 0)] * x.ndim
      widths[axis] = (0, slots[kind] - x.shape[axis])
      return jnp.pad(x, widths)
    return TrainState(jax.tree.map(pad, state.params, self.axes),
                      sharding.map_params(self.tx, pad, state.opt_state, self.axes))

  def init_logical(self, seed: int) -> TrainState:
    """The sharded logical state from `seed` (parameters and optimizer state). Computed under
    its output sharding, so each device builds only its share (no replicated copy). The seed's
    key goes in as data (host numpy, the same on every process), so one program serves every
    seed: runs that reuse an engine do not compile their initialization again."""
    if self._init_fn is None:
      self._init_fn = jax.jit(lambda data: self._init_logical(jax.random.wrap_key_data(data)),
                              out_shardings=self.logical_shardings())
    return self._init_fn(np.asarray(jax.random.key_data(jax.random.key(seed))))

  def abstract_logical(self) -> TrainState:
    """Shapes, dtypes and shardings of the sharded logical state: a restore target."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        jax.eval_shape(functools.partial(self._init_logical, 0)),
                        self.logical_shardings())

  def logical_shardings(self) -> TrainState:
    abstract = jax.eval_shape(functools.partial(self._init_logical, 0))
    return self.state_shardings(abstract.params)

  def state_shardings(self, params_abstract) -> TrainState:
    return TrainState(self.param_shardings,
                      sharding.opt_shardings(self.tx, params_abstract, self.axes, self.mesh))

  def tree_axes(self, tree):
    """The `Axes` tree of a `TrainState` (moments get their parameter's axes) or of a
    parameter-shaped tree."""
    if isinstance(tree, TrainState):
      return migrate.state_axes(tree, self.tx, self.axes)
    return self.axes

  def move(self, tree, old: layout_lib.Layout, new: layout_lib.Layout, *,
           donate: bool = False, chunk="sized"):
    """A `TrainState` (or a parameter-shaped tree) padded in `old`, padded in `new`: the
    migration collective, one (block, kind) group of weights and moments at a time; `donate`
    consumes `tree` group by group."""
    self.check_layout(old)
    self.check_layout(new)
    moves = migrate.plan(old, new, chunk=chunk)
    axes = self.tree_axes(tree)
    return self.migrator().move_groups(tree, axes, moves, migrate.leaf_groups(tree, axes),
                                       donate=donate)

  def compile_moves(self, state, old: layout_lib.Layout, new: layout_lib.Layout) -> None:
    """Compiles every migration `move` may run from `old`'s bucket to `new`'s: each unit kind's
    group programs at every chunk size (`migrate.chunk_sizes`) and at none (nothing of that kind
    moves). `state` is padded in `old`; `new` is a layout one small move away from it."""
    axes = self.tree_axes(state)
    groups = migrate.leaf_groups(state, axes)
    mig = self.migrator()
    # Nothing moves (K = 0): one layout's owners in both buckets (whichever bucket holds them).
    at = lambda a, b: layout_lib.Layout(**{k: u.replace(capacity=b.kinds()[k].capacity,
                                                        widths=b.kinds()[k].widths)
                                           for k, u in a.kinds().items()})
    fits = all(max(u.counts) <= new.kinds()[k].capacity for k, u in old.kinds().items())
    options = [migrate.plan(old, at(old, new), chunk=0) if fits else
               migrate.plan(at(new, old), new, chunk=0)]
    sizes = {k: migrate.chunk_sizes(min(u.capacity, new.kinds()[k].capacity))
             for k, u in old.kinds().items()}
    for i in range(max(len(v) for v in sizes.values())):
      options.append(migrate.plan(old, new, chunk={k: v[min(i, len(v) - 1)]
                                                   for k, v in sizes.items()}))
    for moves in options:
      mig.compile_groups(state, axes, moves, groups, donate=True)

  def to_padded(self, logical, layout: layout_lib.Layout, *, donate: bool = False):
    """The logical state (params + optimizer moments, or a parameter-shaped tree) padded in
    `layout`."""
    return self.move(logical, self.logical_layout, layout, donate=donate)

  def to_logical(self, padded, layout: layout_lib.Layout, *, donate: bool = False):
    """A padded state (or parameter-shaped tree) of `layout` in the sharded logical form."""
    return self.move(padded, layout, self.logical_layout, donate=donate)

  def logical_arrays(self, logical) -> Any:
    """Host numpy copies of a logical tree (params- or state-shaped) with exactly U units on
    every unit axis (the canonical padding cut off): for tests, inspection and small models."""
    units = {k: n * self.unit_sizes[k] for k, n in self.num_units.items()}
    axes = self.tree_axes(logical)

    def cut(x, a):
      x = np.asarray(jax.device_get(x))
      if (unit := a.unit()) is None:
        return x
      axis, kind = unit
      return np.take(x, np.arange(units[kind]), axis=axis)
    return jax.tree.map(cut, logical, axes)

  def init(self, seed: int, layout: layout_lib.Layout) -> TrainState:
    """A padded train state for `layout`, identical in logical form for every layout."""
    return self.to_padded(self.init_logical(seed), layout, donate=True)

  def relayout(self, state: TrainState, old: layout_lib.Layout,
               new: layout_lib.Layout, *, donate: bool = False, chunk="sized") -> TrainState:
    """Moves a padded state from layout `old` to layout `new` (`move`; `chunk=None`: one
    executable serves every pair of layouts of the two buckets)."""
    return self.move(state, old, new, donate=donate, chunk=chunk)

  # --- sharded computation --------------------------------------------------------------------

  def shard_batch(self, batch: dict) -> dict:
    """Host arrays (this process's rows of the global batch, `mesh.batch_feed`) -> arrays split
    over `data`."""
    def one(x):
      x = np.asarray(x)
      global_shape = (x.shape[0] * self.feeds,) + x.shape[1:]
      return jax.make_array_from_process_local_data(self.batch_sharding, x, global_shape)
    return jax.tree.map(one, batch)

  def _local_terms(self, params, batch, plan):
    model = nnx.merge(self.graphdef, params)
    terms = self.loss_terms(model(batch[self.input_key], plan), batch)
    return jax.lax.psum(terms, mesh_lib.DATA)

  def _sharded(self, fn, out_specs, params, batch, plan):
    in_specs = (sharding.specs(self.axes), jax.tree.map(lambda _: P(mesh_lib.DATA), batch),
                plan_lib.plan_specs(plan))
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(
        params, batch, plan)

  def loss_terms_fn(self, params, batch, plan) -> dict:
    """Global {"loss_sum", "count", "correct"} of padded `params` on a sharded batch."""
    return self._sharded(self._local_terms, P(), params, batch, plan)

  def loss(self, params, batch, plan):
    """Mean loss over the global batch, and the summed terms."""
    terms = self.loss_terms_fn(params, batch, plan)
    return terms["loss_sum"] / terms["count"], terms

  def replica_grads_and_terms(self, stacked_params, batch, plan):
    """Each data replica's own gradients, on its own parameters: stacked_params [R, *P]
    (global; row r on replica r's tensor group) -> (gradients [R, *P] of each replica's mean
    loss over its own rows of `batch`, loss terms {name: [R]}). Nothing is summed over `data`
    (the replica modes of `semijax.sync` combine them)."""
    stacked = jax.tree.map(lambda a: P(mesh_lib.DATA, *a.spec()), self.axes)
    in_specs = (stacked, jax.tree.map(lambda _: P(mesh_lib.DATA), batch),
                plan_lib.plan_specs(plan))

    def local(params, batch, plan):
      params = jax.tree.map(lambda x: x[0], params)
      terms = self.loss_terms(nnx.merge(self.graphdef, params)(batch[self.input_key], plan),
                              batch)
      return jax.tree.map(lambda t: jnp.reshape(t, (1,)), terms)

    def losses(stacked_params):
      terms = jax.shard_map(local, mesh=self.mesh, in_specs=in_specs,
                            out_specs=P(mesh_lib.DATA))(stacked_params, batch, plan)
      return jnp.sum(terms["loss_sum"] / terms["count"]), terms

    (_, terms), grads = jax.value_and_grad(losses, has_aux=True)(stacked_params)
    return grads, terms

  def logits(self, params, batch, plan) -> jax.Array:
    """Logits [global batch, ...] (batch split over data), for tests and inspection."""
    def local(params, batch, plan):
      return nnx.merge(self.graphdef, params)(batch[self.input_key], plan)
    return jax.jit(lambda p, b, pl: self._sharded(local, P(mesh_lib.DATA), p, b, pl))(
        params, batch, plan)

  def _train_step(self, state: TrainState, batch, plan):
    self.trace_count += 1
    (loss, terms), grads = jax.value_and_grad(self.loss, has_aux=True)(state.params, batch, plan)
    if plan.resize is not None:
      masks = resize_lib.skip_masks(plan.resize, plan.active, self.axes, self.unit_sizes)
      grads = resize_lib.impute_gradients(plan.resize, masks, grads)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    if plan.resize is not None:   # optionally keep skipped weights and moments as they were
      params = resize_lib.freeze(plan.resize, masks, params, state.params)
      opt_masks = sharding.map_params(self.tx, lambda _, m: m, opt_state, masks,
                                      non_params=lambda _: jnp.zeros((), bool))
      opt_state = resize_lib.freeze(plan.resize, opt_masks, opt_state, state.opt_state)
    metrics = {"loss": loss, "accuracy": terms["correct"] / terms["count"],
               "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state), metrics

  def _eval_step(self, params, batch, plan):
    self.trace_count += 1
    return self.loss_terms_fn(params, batch, plan)

  # --- compiled variants ----------------------------------------------------------------------

  def _key(self, kind, state_or_params, plan, batch):
    # The plan's tree structure holds its static parts (widths, emulation, resize settings);
    # the parameter shapes hold the capacity (a narrowed plan's widths need not end at it).
    params = state_or_params.params if kind == "train" else state_or_params
    return (kind, tuple(x.shape for x in jax.tree.leaves(params)), jax.tree.structure(plan),
            _signature(plan), _signature(batch))

  def _compiled_fn(self, kind, state_or_params, batch, plan):
    key = self._key(kind, state_or_params, plan, batch)
    fn = self._compiled.get(key)
    if fn is None:
      if self.strict:
        raise layout_lib.LayoutError(
            f"layout.capacity: no compiled {kind} step for bucket {plan.widths} with these "
            "shapes; compile it first (Engine.compile)")
      if kind == "train":
        jitted = jax.jit(self._train_step, donate_argnums=(0,),
                         out_shardings=(self.state_shardings(state_or_params.params),
                                        self.replicated))
      else:
        jitted = jax.jit(self._eval_step, out_shardings=self.replicated)
      fn = jitted.lower(_abstract(state_or_params), _abstract(batch), _abstract(plan)).compile()
      self.compile_count += 1
      logging.info("compiled %s step for bucket %s (%d variants)", kind, plan.widths,
                   len(self._compiled) + 1)
      self._compiled[key] = fn
    return fn

  def compile(self, state: TrainState, batch, plan: plan_lib.Plan, eval_batch=None) -> None:
    """Compiles (ahead of time) the train and eval steps for this state/batch/plan bucket."""
    self._compiled_fn("train", state, batch, plan)
    self._compiled_fn("eval", state.params, batch if eval_batch is None else eval_batch,
                      plan.exact())

  def exercise(self, state: TrainState, batch, plan: plan_lib.Plan) -> None:
    """Runs every branch of `plan`'s compiled train step once (`plan_lib.branch_plans`) on a
    throwaway copy of `state`, so that their one-time first-run cost falls here, not in a timed
    step. Each compiled step is exercised once per engine; `state` is left as it is."""
    key = self._key("train", state, plan, batch)
    if key in self._exercised:
      return
    step = self._compiled_fn("train", state, batch, plan)
    for p in plan_lib.branch_plans(plan, self.mesh):
      scratch = jax.tree.map(lambda x: x.copy(), state)
      jax.block_until_ready(step(scratch, batch, p))
    self._exercised.add(key)

  def train_step(self, state: TrainState, batch, plan: plan_lib.Plan):
    """One optimizer step; `state` is donated. Returns (new state, metrics dict of scalars)."""
    return self._compiled_fn("train", state, batch, plan)(state, batch, plan)

  def eval_terms(self, params, batch, plan: plan_lib.Plan) -> dict:
    """Summed loss terms of one evaluation batch; evaluation is exact (`plan.resize` ignored,
    `plan.offload` kept: it is exact)."""
    plan = plan.exact()   # evaluation never resizes
    return self._compiled_fn("eval", params, batch, plan)(params, batch, plan)
