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
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import migrate
from semijax.core import pipeline_batch
from semijax.core import pipeline_layout
from semijax.core import pipeline_model
from semijax.core import pipeline_state
from semijax.core import plan as plan_lib
from semijax.core import schedule as schedule_lib
from semijax.core import sharding
from semijax.core.engine import TrainState

DATA, PIPE, TENSOR = mesh_lib.DATA, mesh_lib.PIPE, mesh_lib.TENSOR
LAYERS = layout_lib.LAYERS
SHARED, STACK = pipeline_model.SHARED, pipeline_model.STACK
PipeLayout = pipeline_layout.PipeLayout          # the names callers import from here
PipePlan = pipeline_layout.PipePlan


# --- the engine ---------------------------------------------------------------------------------


def _vary(x, axes):
  """`x` typed as varying over `axes` (shard_map's check_vma), casting only what it lacks."""
  aval = jax.typeof(x)
  have = getattr(aval, "vma", None)
  if have is None:
    have = getattr(getattr(aval, "mat", None), "varying", frozenset())
  missing = tuple(a for a in axes if a not in have)
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def _invariant_over_tensor(x):
  """`x`, equal on every tensor device, typed as such (pmax is exact on equal values)."""
  aval = jax.typeof(x)
  have = getattr(aval, "vma", None)
  if have is None:
    have = getattr(getattr(aval, "mat", None), "varying", frozenset())
  return jax.lax.pmax(x, TENSOR) if TENSOR in have else x


class PipelineEngine:
  """Runs one model pipelined over a (data, pipe, tensor) mesh (see module doc).

  Args:
    model_fn: rngs -> nnx.Module with `stem(inputs)`, `encoder.blocks`, `encoder.run_blocks`,
      `head_out(x)`, `input_key` and `unit_sizes()` (the models in `semijax.models`).
    loss_terms: (logits, batch) -> {"loss_sum", "count", "correct"} local sums (`models.tasks`).
    mesh: a (data, pipe, tensor) mesh (`mesh.make_pipeline_mesh`).
    tx: the optax optimizer (applied to the stacked parameters; padded rows stay zero).
    schedule: "gpipe" or "1f1b" (`core.schedule`).
    microbatches: the most microbatches any data-parallel pipeline runs in a step (static).
  """

  def __init__(self, model_fn: Callable[[nnx.Rngs], nnx.Module], loss_terms: Callable,
               mesh: jax.sharding.Mesh, tx: optax.GradientTransformation, *,
               schedule: str = "1f1b", microbatches: int = 1):
    if schedule not in schedule_lib.SCHEDULES:
      raise ValueError(f"pipeline.schedule: {schedule!r} is not one of "
                       f"{list(schedule_lib.SCHEDULES)}")
    self.parts = parts = pipeline_model.PipeModel.of(model_fn)
    self.model_fn, self.loss_terms, self.mesh, self.tx = model_fn, loss_terms, mesh, tx
    self.schedule, self.microbatches = schedule, int(microbatches)
    self.graphdef, self.block_graphdef = parts.graphdef, parts.block_graphdef
    self.block_axes, self.axes = parts.block_axes, parts.axes
    self.num_layers, self.input_key = parts.num_layers, parts.input_key
    self.unit_sizes, self.num_units = parts.unit_sizes, parts.num_units
    self.stages, self.tensor_size = mesh.shape[PIPE], mesh.shape[TENSOR]
    self.data_size = mesh.shape[DATA]
    self.states = pipeline_state.PipeStates(parts, mesh, tx)
    self.param_shardings = self.states.param_shardings
    self.replicated = NamedSharding(mesh, P())
    self.batch_sharding = NamedSharding(mesh, P(DATA))
    self._compiled: dict = {}
    self.compile_count = 0

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

  def to_padded(self, logical, layout: PipeLayout, *, donate: bool = False):
    return self.states.to_padded(logical, layout, donate=donate)

  def to_logical(self, padded, layout: PipeLayout, *, donate: bool = False):
    return self.states.to_logical(padded, layout, donate=donate)

  def init(self, seed: int, layout: PipeLayout) -> TrainState:
    return self.states.init(seed, layout)

  def logical_arrays(self, logical) -> Any:
    """Host numpy copies of a logical tree in the unpipelined model's form."""
    return self.states.logical_arrays(logical)

  def state_shardings(self, params_abstract) -> TrainState:
    """Shardings of a padded train state with parameters shaped like `params_abstract`."""
    return self.states.state_shardings(params_abstract)

  # --- the sharded step ---------------------------------------------------------------------------

  def arrange_batch(self, batch: dict, microbatches: Sequence[int]) -> dict:
    """Host arrays of the global batch (sum(microbatches) * microbatch rows, in order) -> arrays
    [data * M * microbatch, ...] split over `data`: replica d gets its `microbatches[d]`
    microbatches, the rest zeros with weight 0 (M = `self.microbatches`)."""
    return pipeline_batch.arrange(batch, microbatches, most=self.microbatches,
                                  batch_sharding=self.batch_sharding)

  def _shared_model(self, shared):
    return self.parts.shared_model(shared)

  def _stage(self, stack, count, plan, x):
    """Runs this stage's layer slots on x [mb, seq, d_model]; slots >= count are skipped."""
    def body(x, item):
      params, slot = item
      run = lambda x: nnx.merge(self.block_graphdef, params)(x, plan)
      return jax.lax.cond(slot < count, run, lambda x: x, x), None
    slots = jnp.arange(jax.tree.leaves(stack)[0].shape[0])
    x, _ = jax.lax.scan(body, x, (stack, slots))
    return x

  def _local(self, params, batch, pplan, *, train: bool, per_replica: bool = False):
    """The per-device body (inside shard_map): the tick loop (see module doc).

    per_replica: `params` are stacked [1, *local] (this data replica's own copy), the loss is
    normalized by this pipeline's own tokens and nothing is summed over `data`: gradients come
    back [1, *local] and terms [1] (`replica_grads_and_terms`)."""
    if per_replica:
      params = jax.tree.map(lambda x: x[0], params)
    s = jax.lax.axis_index(PIPE)
    is_first, is_last = s == 0, s == self.stages - 1
    m_count = self.microbatches
    mbs = jax.tree.map(lambda x: x.reshape((m_count, -1) + x.shape[1:]), batch)
    over_data = (lambda x: x) if per_replica else (lambda x: jax.lax.psum(x, DATA))
    total = over_data(jnp.sum(batch["weights"]))
    plan = plan_lib.Plan({k: v.reshape(1) for k, v in pplan.active.items()}, pplan.widths)
    count = pplan.layers.reshape(())
    table = jnp.take(pplan.table[0], s, axis=1)                         # [T, 2]
    shared = jax.tree.map(lambda x: _vary(x, (DATA, PIPE)), params[SHARED])
    stack = jax.tree.map(lambda x: _vary(x, (DATA,)), params[STACK])
    pick = lambda m: jax.tree.map(lambda x: x[jnp.maximum(m, 0)], mbs)

    def zero_terms(ref):
      z = jnp.zeros_like(ref[(0,) * ref.ndim], jnp.float32)
      return {"loss_sum": z, "count": z, "correct": z}

    def g(shared, stack, x_in, mb):
      """(stage output, loss terms): the embedding first, the stage's layers, the head last."""
      model = self._shared_model(shared)
      x0 = jax.lax.cond(is_first, lambda: model.stem(mb[self.input_key]).astype(x_in.dtype),
                        lambda: x_in)
      h = self._stage(stack, count, plan, x0)
      terms = jax.lax.cond(is_last, lambda: self.loss_terms(model.head_out(h), mb),
                           lambda: zero_terms(h))
      return h, terms

    probe = _vary(jnp.zeros_like(self._shared_model(shared).stem(pick(0)[self.input_key])),
                  (DATA, PIPE))
    # Stash slots: the most microbatches a stage holds between ticks (at least the one a
    # single stage's backward reads in its forward's tick).
    slots = max(1, int(schedule_lib.in_flight(np.asarray(schedule_lib.table(
        self.schedule, self.stages, m_count))).max())) if train else 1
    zeros_grads = lambda t: jax.tree.map(jnp.zeros_like, t)
    carry = {"x": probe, "g": probe, "stash": jnp.stack([probe] * slots),
             "terms": zero_terms(probe)}
    if train:
      carry["d_shared"], carry["d_stack"] = zeros_grads(shared), zeros_grads(stack)

    def tick(carry, row):
      f, b = row[0], row[1]
      out = dict(carry)

      def forward(c):
        mb = pick(f)
        h, terms = g(shared, stack, c["x"], mb)
        stash = c["stash"].at[jnp.maximum(f, 0) % slots].set(c["x"]) if train else c["stash"]
        add = terms if not train else zero_terms(h)
        return h, stash, jax.tree.map(jnp.add, c["terms"], add)

      skip_f = lambda c: (jnp.zeros_like(c["x"]), c["stash"], c["terms"])
      h, out["stash"], out["terms"] = jax.lax.cond(f >= 0, forward, skip_f, carry)
      dx = jnp.zeros_like(carry["g"])
      if train:
        def backward(c):
          mb = pick(b)
          x_b = c["stash"][jnp.maximum(b, 0) % slots]
          (_, terms), vjp = jax.vjp(lambda sh, st, x: g(sh, st, x, mb), shared, stack, x_b)
          seed = jnp.where(is_last, 1.0 / total, 0.0).astype(jnp.float32)
          cot_terms = {k: jnp.zeros_like(v) for k, v in terms.items()}
          cot_terms["loss_sum"] = cot_terms["loss_sum"] + seed
          cot_h = jnp.where(is_last, jnp.zeros_like(c["g"]), c["g"])
          d_sh, d_st, d_x = vjp((cot_h, cot_terms))
          return (jax.tree.map(jnp.add, c["d_shared"], d_sh),
                  jax.tree.map(jnp.add, c["d_stack"], d_st), d_x,
                  jax.tree.map(jnp.add, c["terms"], terms))

        skip_b = lambda c: (c["d_shared"], c["d_stack"], jnp.zeros_like(c["g"]), c["terms"])
        after_f = dict(carry, stash=out["stash"], terms=out["terms"])
        out["d_shared"], out["d_stack"], dx, out["terms"] = jax.lax.cond(
            b >= 0, backward, skip_b, after_f)
      if self.stages > 1:
        out["x"] = jax.lax.ppermute(h, PIPE, [(i, i + 1) for i in range(self.stages - 1)])
        out["g"] = jax.lax.ppermute(dx, PIPE, [(i + 1, i) for i in range(self.stages - 1)])
      else:
        out["x"], out["g"] = jnp.zeros_like(h), jnp.zeros_like(dx)
      return out, None

    carry, _ = jax.lax.scan(tick, carry, table)
    terms = jax.tree.map(_invariant_over_tensor,
                         over_data(jax.lax.psum(carry["terms"], PIPE)))
    if not train:
      return terms
    d_shared = jax.tree.map(_invariant_over_tensor,
                            over_data(jax.lax.psum(carry["d_shared"], PIPE)))
    grads = {SHARED: d_shared, STACK: over_data(carry["d_stack"])}
    if per_replica:
      lead = lambda x: x[None]
      return jax.tree.map(lead, grads), jax.tree.map(lead, terms)
    return grads, terms

  def _sharded(self, fn, out_specs, params, batch, pplan, param_specs=None):
    plan_specs = PipePlan({k: P(PIPE, TENSOR) for k in pplan.active}, P(PIPE), P(DATA),
                          pplan.widths)
    param_specs = sharding.specs(self.axes) if param_specs is None else param_specs
    in_specs = (param_specs, jax.tree.map(lambda _: P(DATA), batch), plan_specs)
    return jax.shard_map(fn, mesh=self.mesh, in_specs=in_specs, out_specs=out_specs)(
        params, batch, pplan)

  def replica_grads_and_terms(self, stacked_params, batch, pplan):
    """Each data-parallel pipeline's own gradients, on its own parameters: stacked_params
    [R, *P] (global; row d on pipeline d's devices) -> (gradients [R, *P] of each pipeline's
    mean loss over its own microbatches' tokens, loss terms {name: [R]}). Nothing is summed over
    `data` (the replica modes of `semijax.sync` combine them)."""
    stacked = jax.tree.map(lambda s: P(DATA, *s), sharding.specs(self.axes))
    return self._sharded(functools.partial(self._local, train=True, per_replica=True),
                         (stacked, P(DATA)), stacked_params, batch, pplan, param_specs=stacked)

  def grads_and_terms(self, params, batch, pplan):
    """(gradients like `params`, summed loss terms) of one step's global batch."""
    specs = sharding.specs(self.axes)
    return self._sharded(functools.partial(self._local, train=True), (specs, P()), params,
                         batch, pplan)

  def _train_step(self, state: TrainState, batch, pplan):
    grads, terms = self.grads_and_terms(state.params, batch, pplan)
    updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": terms["loss_sum"] / terms["count"],
               "accuracy": terms["correct"] / terms["count"], "grad_norm": optax.tree.norm(grads)}
    return TrainState(params, opt_state), metrics

  def _eval_terms(self, params, batch, pplan):
    return self._sharded(functools.partial(self._local, train=False), P(), params, batch, pplan)

  def _compiled_fn(self, kind, state_or_params, batch, pplan):
    params = state_or_params.params if kind == "train" else state_or_params
    key = (kind, tuple(x.shape for x in jax.tree.leaves(params)), jax.tree.structure(pplan),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(pplan)),
           tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(batch)))
    fn = self._compiled.get(key)
    if fn is None:
      abstract = lambda t: jax.tree.map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), t)
      if kind == "train":
        out_sh = (TrainState(self.param_shardings, jax.tree.map(lambda x: x.sharding,
                                                                state_or_params.opt_state)),
                  self.replicated)
        jitted = jax.jit(self._train_step, donate_argnums=(0,), out_shardings=out_sh)
      else:
        jitted = jax.jit(self._eval_terms, out_shardings=self.replicated)
      fn = jitted.lower(abstract(state_or_params), abstract(batch), abstract(pplan)).compile()
      self.compile_count += 1
      logging.info("compiled pipelined %s step (%d variants)", kind, len(self._compiled) + 1)
      self._compiled[key] = fn
    return fn

  def compile(self, state: TrainState, batch, pplan: PipePlan, eval_batch=None) -> None:
    self._compiled_fn("train", state, batch, pplan)
    self._compiled_fn("eval", state.params, batch if eval_batch is None else eval_batch, pplan)

  def shard_batch(self, batch: dict) -> dict:
    """`arrange_batch` with `self.microbatches` microbatches for every pipeline (the replica
    modes: pipeline d takes rows [d B / R, (d + 1) B / R) of the global batch)."""
    return self.arrange_batch(batch, (self.microbatches,) * self.data_size)

  def train_step(self, state: TrainState, batch, pplan: PipePlan):
    """One optimizer step; `state` is donated. Returns (new state, metrics dict of scalars)."""
    return self._compiled_fn("train", state, batch, pplan)(state, batch, pplan)

  def eval_terms(self, params, batch, pplan: PipePlan) -> dict:
    return self._compiled_fn("eval", params, batch, pplan)(params, batch, pplan)

