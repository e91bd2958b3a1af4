"""The tensor-parallel executor (`TensorParallel`): a `core.engine.Engine` on a data x tensor
mesh, its units placed by a balancing policy (`balance.coordinator.Balancer`), which may move
them between steps; and how a run builds its engine and emulated slowdown.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from semijax import models
from semijax.balance import coordinator as coordinator_lib
from semijax.core import emulation
from semijax.core import engine as engine_lib
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline as pipeline_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import executor as executor_lib
from semijax.train import optimizer as optimizer_lib
from semijax.train import prefetch as prefetch_lib
from semijax.train import steps as steps_lib


def build_engine(run: config_lib.RunConfig) -> engine_lib.Engine:
  """The engine of a run (model, optimizer, mesh)."""
  model_fn, loss_terms = models.build(run.model)
  return engine_lib.Engine(model_fn, loss_terms, run.mesh.make(),
                           optimizer_lib.make(run.optimizer, run.steps), kernel=run.kernel,
                           accumulation=run.accumulation)


def step_tokens(run: config_lib.RunConfig) -> int:
  """Tokens one tensor group computes in a step: its data replica's rows x seq_len."""
  return run.batch_size // run.mesh.data * run.model.seq_len


def build_emulator(run: config_lib.RunConfig) -> emulation.Emulator | None:
  """The emulated slowdown of a run (`config.hetero.slowdown`, `hetero.replica_slowdown`), or
  None. Emulated replicas need an emulator even without a tensor profile (their tensor groups'
  time is the unit their factors multiply); a sync step waits for the slowest replica, so under
  mode sync every tensor device's time is multiplied by the largest replica factor."""
  slowdown, replicas = run.hetero.slowdown, run.sync.replica_slowdown
  if slowdown is None and replicas is None:
    return None
  hetero = run.hetero
  if replicas is not None:
    factor = max(replicas) if run.sync.mode == "sync" else 1.0
    hetero = dataclasses.replace(hetero, slowdown=tuple(
        s * factor for s in (slowdown or (1.0,) * run.mesh.tensor)))
  return emulation.emulator(hetero, run.model, step_tokens(run))


def cached_engine(run: config_lib.RunConfig, cache: dict | None) -> engine_lib.Engine:
  """A new engine, or one of `cache` whose model, mesh, optimizer (schedule included), batch,
  width kernel and gradient accumulation match. Runs of different lengths on one schedule share
  an engine and its compiled steps."""
  if cache is None:
    return build_engine(run)
  schedule = optimizer_lib.schedule_length(run.optimizer, run.steps)
  key = (run.model, run.mesh, dataclasses.replace(run.optimizer, schedule_steps=schedule),
         run.batch_size, run.kernel, run.accumulation)
  if key not in cache:
    cache[key] = build_engine(run)
  return cache[key]


def restore_pipelined(engine: engine_lib.Engine, ckpt: checkpoint_lib.Checkpointer, step: int):
  """(`engine`'s logical state, meta) from a pipelined checkpoint: restored onto one stage of
  every layer over the engine's own devices and tensor count (the stacked rows past the last
  layer, padding, cut off; each device holds what the unpipelined run holds), then unstacked."""
  m = engine.mesh.shape
  stage = pipeline_lib.PipelineEngine(
      engine.model_fn, engine.loss_terms,
      mesh_lib.make_pipeline_mesh(m[mesh_lib.DATA], 1, m[mesh_lib.TENSOR],
                                  list(engine.mesh.devices.flat)), engine.tx)
  logical, meta = ckpt.restore(stage.abstract_logical(), step)
  return stage.unstacked(logical, engine.logical_shardings()), meta


class TensorParallel:
  """The `executor.Executor` of a tensor-parallel run (`config.mesh.pipe` 1): every step runs on
  the layout the balancer picks for it (`Balancer.before_step` may migrate the state first).

  Args:
    run: the validated run.
    workdir: where the balancer's decision log goes.
    engine_cache: a dict to share engines between runs of one process (`cached_engine`).

  Attributes:
    engine, balancer, dataset: the run's; state: the padded train state (None before
    `init` or `restore`); extra: the host state a restore read ({"balance", "snapshot"}) or
    None (the replica loops read it).
  """

  step_name = "step"
  own_checkpoints = False

  def __init__(self, run: config_lib.RunConfig, workdir: str, engine_cache: dict | None = None):
    feed_index, feeds = mesh_lib.batch_feed(run.mesh.make())
    self.run = run
    self.dataset = data_lib.build(run.data, feed_index, feeds)
    self.engine = cached_engine(run, engine_cache)
    self.balancer = coordinator_lib.Balancer.create(
        self.engine, settings=run.balance, resize_spec=run.resize, hetero=run.hetero,
        spec=run.model, layout=run.layout, workdir=workdir,
        steps_per_epoch=self.dataset.steps_per_epoch, seed=run.seed,
        emulator=build_emulator(run), tokens=step_tokens(run))
    self.state, self.extra, self.plan = None, None, None
    self._eval_batches = None
    make = lambda step: self.engine.shard_batch(self.dataset.train_batch(step))
    self.batches: prefetch_lib.Batches = (prefetch_lib.Prefetch(make) if run.run_ahead
                                          else prefetch_lib.OnTheSpot(make))
    self._ahead: list[int] = []      # steps dispatched since the last one waited for
    self._since, self._balancing_s = 0.0, 0.0
    self._previous = None            # the metrics of the step dispatched before

  def close(self) -> None:
    self.batches.close()
    self.balancer.close()

  def init(self, seed: int) -> None:
    self.state = self.engine.init(seed, self.balancer.layout)

  def restore(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> tuple[int, str]:
    """Restores onto the balancer's layout, which may differ from the saved one (another
    layout or tensor device count), with the balancer's host state and priority snapshot. A
    pipelined run's checkpoint (sync mode) restores too (`restore_pipelined`)."""
    checkpoint_lib.check_sync_mode(meta, self.run.sync.mode, step, ckpt.directory)
    checkpoint_lib.check_stages(meta, self.run.sync.mode, None, step, ckpt.directory)
    engine, layout = self.engine, self.balancer.layout
    abstract = engine.abstract_logical()
    if "pipe" in meta:
      logical, meta = restore_pipelined(engine, ckpt, step)
      saved_with = f"pipelined, layers per stage {meta['plan']['stage_layers']}"
    else:
      logical, meta = ckpt.restore(abstract, step)
      saved_with = f"MLP units {checkpoint_lib.unit_counts(meta, 'mlp')}"
    saved_with += checkpoint_lib.dtype_change(meta, abstract)
    # a policy that does not resize has no use for a resizing run's priority snapshot
    snapshot = ckpt.restore_snapshot(abstract.params, step) if self.balancer.resizes else None
    self.extra = {"balance": ckpt.restore_extra(step), "snapshot": None if snapshot is None else
                  engine.to_padded(snapshot, layout, donate=True)}
    self.state = engine.to_padded(logical, layout, donate=True)
    self.balancer.load_state_dict(self.extra["balance"])
    if self.extra["snapshot"] is not None:
      self.balancer.snapshot = self.extra["snapshot"]
    return int(meta["data_position"]), saved_with

  @property
  def eval_batches(self) -> list:
    """The evaluation batches, sharded for the engine (once)."""
    if self._eval_batches is None:
      self._eval_batches = [self.engine.shard_batch(b) for b in self.dataset.eval_batches()]
    return self._eval_batches

  def warm_up(self, step: int) -> str:
    """Compiles and runs every step variant the policy may use (`Balancer.warm_up`)."""
    compiles_before = self.engine.compile_count
    self.state = self.balancer.warm_up(
        self.state, self.engine.shard_batch(self.dataset.train_batch(step)),
        self.eval_batches[0], step=step)
    sampler = self.balancer.sampler
    return (f"policy {self.balancer.policy.name}, "
            f"{self.engine.compile_count - compiles_before} step programs compiled"
            + ("" if sampler is None else f"; speeds: {sampler.describe()}"))

  def step(self, step: int) -> executor_lib.StepResult:
    """The balancer's layout for `step` (migrating first if it changed), the step (its batch
    made while the step before ran, `prefetch.Prefetch`), and the balancer's view of the step's
    time. The step runs ahead (dispatched, not waited for: metrics on the devices, seconds
    None) unless the balancer must see its time first (`Balancer.must_wait`); the steps that ran
    ahead then share the time until it ends (less what balancing took outside the steps). On
    XLA:CPU at most two steps are in flight."""
    balancer = self.balancer
    batch = self.batches.get(step)
    t0 = time.perf_counter()
    self.state, self.plan = balancer.before_step(step, self.state)   # may migrate the state
    t1 = time.perf_counter()
    if not self._ahead:
      self._since, self._balancing_s = t1, 0.0
    else:
      self._balancing_s += t1 - t0
    self.state, m = self.engine.train_step(self.state, batch, self.plan)
    balancer.dispatched()
    self._ahead.append(step)
    if self.engine.programs.scratch_runs and len(self._ahead) > 1:
      # XLA:CPU: at most two steps in flight. A longer queue of collective programs now and
      # then deadlocks its device threads until XLA aborts (see `core.migrate`'s module doc).
      jax.block_until_ready(self._previous)
    self._previous = m
    scalars = {}
    if (keep := balancer.setup(step).keep) is not None:
      scalars.update({"resize/min_keep": min(keep),
                      "resize/resized_devices": sum(k < 1 for k in keep)})
    decision = balancer.decision
    changed = decision is not None and decision.changed
    notes = (f"balance step {step + 1}: {decision.reason}",) if changed else ()
    if self.run.run_ahead and not balancer.must_wait(step):
      return executor_lib.StepResult(m, None, scalars, notes)
    metrics = {k: float(v) for k, v in jax.device_get(m).items()}    # waits for the step
    balancer.emulate()                               # an emulated straggler's extra time
    step_s = (time.perf_counter() - self._since - self._balancing_s) / len(self._ahead)
    for s in self._ahead:
      timed = balancer.timed(s, step_s)
    self._ahead = []
    scalars.update(timed)
    seconds = time.perf_counter() - t0               # the step and everything balancing costs
    return executor_lib.StepResult(metrics, seconds, scalars, notes)

  def evaluate(self) -> dict:
    return steps_lib.evaluate(self.engine, self.state.params, self.eval_batches, self.plan)

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> None:
    """Saves with the layout in the meta and the balancer's host state; the state (and a
    priority snapshot) go through the sharded logical form in place (donated group by group),
    so no device holds two copies."""
    engine, balancer = self.engine, self.balancer
    layout = balancer.layout
    logical = engine.to_logical(self.state, layout, donate=True)
    snapshot = balancer.snapshot
    if snapshot is not None:
      snapshot = engine.to_logical(snapshot, layout, donate=True)
    ckpt.save(step, logical, dict(meta, layout=layout.to_json()), balancer.state_dict(),
              snapshot)
    if snapshot is not None:
      balancer.snapshot = engine.to_padded(snapshot, layout, donate=True)
    self.state = engine.to_padded(logical, layout, donate=True)

  def summary(self, base: dict) -> executor_lib.Finish:
    b = self.balancer.summary(float(np.sum(base["step_times_s"])))
    return executor_lib.Finish(
        {"balance": b}, after_val=f", {b['migrations']} migrations, "
        f"{b['compiles_after_warmup']} compiles after warm-up")
