"""The engine's compiled step programs: `StepPrograms`, one ahead-of-time compiled train and eval
step per layout bucket (capacities and compute widths), kept and counted. Owned counts and
active widths are data (`plan_lib.Plan`), so changing them inside a bucket reuses the compiled
step."""

from __future__ import annotations

import logging
from typing import Callable

import jax
from jax.sharding import NamedSharding

from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib


def _abstract(tree):
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), tree)


def _signature(tree) -> tuple:
  return tuple((jax.tree_util.keystr(k), tuple(v.shape), str(v.dtype))
               for k, v in jax.tree_util.tree_leaves_with_path(tree))


class StepPrograms:
  """The compiled train and eval steps of one engine, by bucket.

  Args:
    train_step: the pure (state, batch, plan) -> (state, metrics) (`StepFunctions.train_step`).
    eval_step: the pure (params, batch, plan) -> terms (`StepFunctions.eval_step`).
    state_shardings: params_abstract -> the `TrainState` of shardings the train step returns.
    replicated: the mesh's replicated sharding (metrics and terms).
    mesh: the mesh (`exercise` runs every branch of a plan on it).
    strict: if True, a step for a bucket that was not compiled raises instead of compiling.

  Attributes:
    scratch_runs: whether warm-up runs steps on a throwaway copy of the state (`exercise`, a
      balancer's trial step): on XLA:CPU only, where a compiled branch's first run costs far
      more than the next (in the thunks' first execution); elsewhere the copy would double a
      state that may fill the accelerator, for no saving.
  """

  def __init__(self, train_step: Callable, eval_step: Callable, state_shardings: Callable,
               replicated: NamedSharding, mesh: jax.sharding.Mesh, *, strict: bool = False):
    self.train_step_fn, self.eval_step_fn = train_step, eval_step
    self.state_shardings, self.replicated, self.mesh = state_shardings, replicated, mesh
    self.strict = strict
    self.scratch_runs = mesh.devices.flat[0].platform == "cpu"
    self._compiled: dict = {}
    self._exercised: set = set()
    self.compile_count = 0   # the XLA compilations asked for

  def _key(self, kind, state_or_params, plan, batch):
    # The plan's tree structure holds its static parts (widths, emulation, resize settings);
    # the parameter shapes hold the capacity (a narrowed plan's widths need not end at it).
    params = state_or_params.params if kind == "train" else state_or_params
    return (kind, tuple(x.shape for x in jax.tree.leaves(params)), jax.tree.structure(plan),
            _signature(plan), _signature(batch))

  def compiled_fn(self, kind, state_or_params, batch, plan):
    """The compiled `kind` ("train" or "eval") step for these shapes, compiled if new."""
    key = self._key(kind, state_or_params, plan, batch)
    fn = self._compiled.get(key)
    if fn is None:
      if self.strict:
        raise layout_lib.LayoutError(
            f"layout.capacity: no compiled {kind} step for bucket {plan.widths} with these "
            "shapes; compile it first (Engine.compile)")
      if kind == "train":
        jitted = jax.jit(self.train_step_fn, donate_argnums=(0,),
                         out_shardings=(self.state_shardings(state_or_params.params),
                                        self.replicated))
      else:
        jitted = jax.jit(self.eval_step_fn, out_shardings=self.replicated)
      with mesh_lib.lowering_scope(self.mesh):
        fn = jitted.lower(_abstract(state_or_params), _abstract(batch), _abstract(plan)).compile()
      self.compile_count += 1
      logging.info("compiled %s step for bucket %s (%d variants)", kind, plan.widths,
                   len(self._compiled) + 1)
      self._compiled[key] = fn
    return fn

  def compile(self, state, batch, plan: plan_lib.Plan, eval_batch=None) -> None:
    """Compiles (ahead of time) the train and eval steps for this state/batch/plan bucket."""
    self.compiled_fn("train", state, batch, plan)
    self.compiled_fn("eval", state.params, batch if eval_batch is None else eval_batch,
                     plan.exact())

  def exercise(self, state, batch, plan: plan_lib.Plan) -> None:
    """Runs every branch of `plan`'s compiled train step once (`plan_lib.branch_plans`) on a
    throwaway copy of `state`, so that their one-time first-run cost falls here, not in a timed
    step. Each compiled step is exercised once; `state` is left as it is. Without
    `scratch_runs` (off CPU) it only compiles."""
    key = self._key("train", state, plan, batch)
    if key in self._exercised:
      return
    step = self.compiled_fn("train", state, batch, plan)
    for p in plan_lib.branch_plans(plan, self.mesh) if self.scratch_runs else ():
      scratch = jax.tree.map(lambda x: x.copy(), state)
      jax.block_until_ready(step(scratch, batch, p))
    self._exercised.add(key)

  def train_step(self, state, batch, plan: plan_lib.Plan):
    """One optimizer step; `state` is donated. Returns (new state, metrics dict of scalars)."""
    return self.compiled_fn("train", state, batch, plan)(state, batch, plan)

  def eval_terms(self, params, batch, plan: plan_lib.Plan) -> dict:
    """Summed loss terms of one evaluation batch; evaluation is exact (`plan.resize` ignored,
    `plan.offload` kept: it is exact)."""
    plan = plan.exact()   # evaluation never resizes
    return self.compiled_fn("eval", params, batch, plan)(params, batch, plan)
