"""The executor of the replica modes in one process (`Replicas`): `config.sync.mode` ssaw,
async and local_sgd, the replicas the `data` axis of the mesh, their speeds emulated
(`hetero.replica_slowdown`). It wraps the run's own executor (tensor-parallel, or pipelined:
its data-parallel pipelines are the replicas), which builds, initializes and restores the
state, and drives the mode's update (`replica_modes`) on it, the units placed by the wrapped
executor's `executor.Placement` (the balancer, or `pipelined.FixedPlan`).

How the training loop's steps read here, all following from replicas that do not step
together:
  * a step is an *update*: one round (ssaw, async) or one local step of every replica
    (local_sgd); the run ends when every sample of its budget (steps x batch_size) has been
    applied, which may take more updates than `steps` (ssaw and async make smaller updates);
  * the learning-rate schedule runs over samples applied (`steps` x batch_size of them);
  * each update's wall time is its real compute plus the emulated seconds the round rule gives
    (the host sleeps them), not the slowest tensor device of a lockstep step;
  * evaluation comes when the samples applied cross a multiple of eval_every x batch_size (and
    at the end); local_sgd evaluates the averaged model at its next average;
  * checkpoints (every checkpoint_every updates and at the end) also hold the in-flight state
    (`extra["sync"]`), so a resumed run continues exactly.
The summary has the loop's keys plus "balance" and "sync": mode, samples, updates, the
validation curve against wall time and the microbatches each replica computed.
"""

from __future__ import annotations

import time

import numpy as np

from semijax.core import compiles
from semijax.core import emulation
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import executor as executor_lib
from semijax.train import replica_modes
from semijax.train import steps as steps_lib


class Replicas:
  """The `executor.Executor` of a replica mode in one process.

  Args:
    run: the validated run (its sync mode not "sync").
    base: the run's executor of its kind (`tensor.TensorParallel`, `pipelined.Pipelined`),
      holding the engine, data and train state (its owner closes it).
    placement: where the units are for each update (`base.balancer`, `pipelined.FixedPlan`).
    meta: what joins every checkpoint's metadata (a pipelined run's plan).
  """

  step_name = "update"
  own_checkpoints = False

  def __init__(self, run: config_lib.RunConfig, base, placement: executor_lib.Placement,
               meta: dict | None = None):
    self.run, self.base, self.placement = run, base, placement
    self.engine = base.engine
    mode = replica_modes.LocalSGD if run.sync.mode == "local_sgd" else replica_modes.Rounds
    self.driver = mode(run, self.engine, placement)
    self.meta = dict(meta or {})
    self.batches = replica_modes.Batches(base.dataset, run.mesh.data)
    self.eval_batches = [self.engine.shard_batch(b) for b in base.dataset.eval_batches()]
    self.factors = np.asarray(run.sync.replica_slowdown or (1.0,) * run.mesh.data, np.float64)
    self.plan, self.clock, self.curve = None, 0.0, []

  @property
  def state(self):
    return self.base.state

  @state.setter
  def state(self, value) -> None:
    self.base.state = value

  def close(self) -> None:
    """Nothing of its own: the wrapped executor is closed by whoever built it."""

  def init(self, seed: int) -> None:
    self.base.init(seed)

  def restore(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> tuple[int, str]:
    """The wrapped executor's restore; the in-flight state it read loads at warm-up."""
    return self.base.restore(ckpt, step, meta)

  def durations(self) -> np.ndarray:
    """Emulated seconds of each replica's microbatch now: its tensor group's emulated time
    (`Balancer.delay_s`; a pipelined run's `FixedPlan.delay_s` gives one per pipeline) times its
    factor; 1 each (and no sleeping) without emulation."""
    base = self.placement.delay_s if self.placement.emulator is not None else 1.0
    return base * self.factors

  def warm_up(self, step: int) -> str:
    """Compiles the placement's programs and the mode's (run once on throwaway copies), then
    continues the restored in-flight state or starts the replicas' first microbatches."""
    placement, driver = self.placement, self.driver
    self.state = placement.warm_up(
        self.state, self.engine.shard_batch(self.batches.global_batch(0)), self.eval_batches[0],
        step=0)
    self.state, self.plan = placement.before_step(step, self.state)
    self.state = driver.warm_up(self.state, self.plan, self.batches)
    placement.compiles_at_warmup = compiles.count()    # the replica programs are warm-up too
    extra = getattr(self.base, "extra", None) or {}
    saved = extra.get("sync")
    if saved is None:     # the tensor-parallel executor nests the host state under "balance"
      saved = (extra.get("balance") or {}).get("sync")
    if saved is not None:
      driver.load_state_dict(saved, placement.layout)
    else:
      self.state = driver.begin(self.state, self.plan, self.batches, self.durations())
    d = np.broadcast_to(self.durations(), self.factors.shape)
    slowdown = tuple(round(float(x), 3) for x in d / d.min())
    return (f"sync mode {self.run.sync.mode}, {self.run.mesh.data} replicas (time per "
            f"microbatch relative to the fastest {slowdown})")

  def step(self, step: int) -> executor_lib.StepResult:
    """Update `step` (0-based): the placement's layout for it, the mode's update, the
    emulated seconds it gives."""
    placement = self.placement
    t0 = time.perf_counter()
    self.state, self.plan = placement.before_step(step, self.state)
    self.state, u = self.driver.update(self.state, self.plan, self.batches, self.durations())
    if placement.emulator is not None:
      emulation.Emulator.sleep(u.emulated_s)
    placement.after_step(step, time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    self.clock += seconds
    applied = self.driver.applied
    scalars = dict(u.scalars, **{"sync/samples": applied,
                                 "sync/progress": applied / self.run.batch_size})
    grad_norm = scalars.pop("train/grad_norm", None)
    return executor_lib.StepResult(
        {"loss": u.loss, "accuracy": u.accuracy, "grad_norm": grad_norm,
         "loss_scale": scalars.pop("train/loss_scale", None)}, seconds, scalars,
        samples=u.samples, evaluable=u.evaluable)

  def evaluate(self) -> dict:
    """Validates the mode's model now (local_sgd: the last average) and adds it to the curve."""
    val = steps_lib.evaluate(self.engine, self.driver.params(self.state), self.eval_batches,
                             self.plan)
    self.curve.append([self.clock, self.driver.applied, val["val/loss"], val["val/accuracy"]])
    return val

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> None:
    """Checkpoints the state with the placement's host state and the mode's in-flight state."""
    layout = self.placement.layout
    extra = dict(self.placement.state_dict() or {})
    extra["sync"] = self.driver.state_dict(layout)
    meta = {**self.meta, **meta, "layout": layout.to_json(), "sync_mode": self.run.sync.mode,
            "samples": self.driver.applied}
    ckpt.save(step, self.engine.to_logical(self.state, layout), meta, extra)

  def summary(self, base: dict) -> executor_lib.Finish:
    driver = self.driver
    keys = {"balance": self.placement.summary(float(np.sum(base["step_times_s"]))),
            "sync": {"mode": self.run.sync.mode, "updates": base["steps"],
                     "samples": driver.applied, "curve": self.curve, **driver.summary()}}
    return executor_lib.Finish(keys, before_val=f", {driver.applied} samples")
