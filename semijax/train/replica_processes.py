"""The executor of the replica modes with one replica per process (`ProcessReplicas`): several
processes joined by jax.distributed, `config.sync.mode` ssaw, async or local_sgd.

Each process trains its replica on its own devices (a local mesh: its row of the (data, tensor)
mesh) and the replicas combine as `semijax.sync.real` describes: ssaw / async in rounds decided
by a coordinator thread in process 0 and applied by collectives among each round's members;
local_sgd with one all-reduce of the parameters every `local_steps` steps. Every process runs
the training loop (`trainer.Trainer`) over its own updates: a step is a round this replica is in
(ssaw, async) or one local step (local_sgd); its samples are the run's progress since this
replica's previous update, and the step that applies the last sample of the budget waits for
the coordinator's end (rounds after it only hand members the final state).

The clock is the wall clock (real speeds, e.g. a competing process on one core). Validation is
deferred so that it never delays a replica: when the samples applied cross a multiple of
eval_every x batch_size, one process keeps a copy of the parameters (`evaluate` returns nothing
then), and the last step's evaluation validates every copy on every process and the final
parameters; the summary's "sync"/"curve" pairs each with the seconds since the start at which
it existed. Process 0 writes the metrics and every round (members, staleness, microbatches,
seconds) to workdir/sync_rounds.json.

Checkpoints: every process saves together, the global parameters as the train state (a
synchronous run of the same model can load it) and in the meta the curve so far (validated at
the save), the records and each process's update count. local_sgd's processes step in lockstep:
they save every checkpoint_every steps, with every replica and the outer momentum as host state
(gathered), and a SIGTERM stops them at one step. ssaw / async processes do not step together:
they save where the rounds say (`own_checkpoints`), at a cut (a round of every replica, after
which none holds a gradient) and at the end, under the round's version
(`process_modes.Rounds`).
"""

from __future__ import annotations

import json
import os
import time
import weakref

import jax

from semijax.core import engine as engine_lib
from semijax.errors import ConfigError
from semijax.sync import real as real_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import executor as executor_lib
from semijax.train import process_modes
from semijax.train import replica_modes
from semijax.train import steps as steps_lib


ROUNDS_NAME = "sync_rounds.json"


# {the job's engine: this process's replica engine}: runs of one engine share it (and the
# compiled programs hanging off it).
_LOCAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _local_engine(engine: engine_lib.Engine) -> engine_lib.Engine:
  if engine not in _LOCAL:
    _LOCAL[engine] = engine_lib.Engine(engine.model_fn, engine.loss_terms,
                                       real_lib.local_mesh(engine.mesh), engine.tx,
                                       kernel=engine.kernel,
                                       accumulation=engine.steps.accumulation)
  return _LOCAL[engine]


def _rehome(state: engine_lib.TrainState, shardings: engine_lib.TrainState):
  """The same per-device shards under other shardings: this process's local copy of a global
  state replicated over `data` (local shardings), or the global state of local copies that are
  the same on every process (global ones)."""
  return jax.tree.map(lambda x, s: jax.make_array_from_single_device_arrays(
      x.shape, s, [a.data for a in x.addressable_shards]), state, shardings)


class ProcessReplicas:
  """The `executor.Executor` of a replica mode with one replica per process.

  Args:
    run: the validated run (sync mode ssaw, async or local_sgd; several processes).
    base: the run's tensor-parallel executor (`tensor.TensorParallel`: the job's engine and
      the global initial state; its owner closes it).
    workdir: where process 0 writes the rounds.
  """

  step_name = "update"

  def __init__(self, run: config_lib.RunConfig, base, workdir: str):
    self.run, self.base, self.workdir = run, base, workdir
    self.local = _local_engine(base.engine)
    dataset = data_lib.build(run.data, 0, 1)     # any process may claim any microbatch
    self.batches = replica_modes.Batches(dataset, run.mesh.data)
    self.eval_batches = [self.local.shard_batch(b) for b in dataset.eval_batches()]
    self.layout = base.balancer.layout
    self.plan = self.local.plan(self.layout)
    self.mode = (process_modes.LocalSGD if run.sync.mode == "local_sgd" else
                 process_modes.Rounds)(self)
    self.state, self.programs, self.saved = None, None, None
    self.preemption = None          # ssaw / async: the SIGTERM this process heard (the loop's)
    self.snapshots: list = []       # (seconds, samples, host params) this process kept
    self.seen = 0                   # the run's samples applied as of this replica's last step
    self.finished = False
    self.curve: list = []           # [seconds, samples, val loss, val accuracy] validated so far

  def close(self) -> None:
    """Nothing of its own: the wrapped executor is closed by whoever built it."""

  def init(self, seed: int) -> None:
    self.base.init(seed)
    self.state = _rehome(self.base.state, self.local.state_shardings(self.base.state.params))

  @property
  def own_checkpoints(self) -> bool:
    """ssaw / async: the rounds say when to save (a cut, and the end); local_sgd's processes
    step together, so the loop's cadence holds for them."""
    return not self.mode.steps_together

  def restore(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> tuple[int, str]:
    """The global parameters through the wrapped executor (onto this run's layout); the mode's
    state (local_sgd's replicas, the coordinator's resume point) loads at warm-up."""
    mode, processes = self.run.sync.mode, jax.process_count()
    sync = meta.get("sync")
    if meta.get("sync_mode") != mode or sync is None:
      raise ConfigError(
          f"config.sync.mode: the checkpoint at step {step} in {ckpt.directory} was saved by a "
          f"{meta.get('sync_mode', 'sync')!r} run with {meta.get('processes', 1)} process(es); "
          f"this {mode!r} run with one replica per process continues only its own kind (use "
          "another --workdir)")
    if len(sync["processes"]) != processes:
      raise ConfigError(
          f"mesh.data: the checkpoint at step {step} in {ckpt.directory} was saved by "
          f"{len(sync['processes'])} processes, one replica each; this run has {processes}")
    _, saved_with = self.base.restore(ckpt, step, meta)
    self.state = _rehome(self.base.state, self.local.state_shardings(self.base.state.params))
    mine = sync["processes"][jax.process_index()]
    self.saved = {"host": (self.base.extra["balance"] or {}).pop("sync", None), "meta": sync,
                  "mine": mine}
    self.curve, self.seen = list(sync["curve"]), int(meta["samples"])
    return int(mine["updates"]), saved_with

  def warm_up(self, step: int) -> str:
    """Compiles this replica's programs and the collectives among the processes; a restored
    run's mode state loads here."""
    del step
    self.programs = replica_modes.programs_for(self.local, self.run.sync).bind(self.state)
    self.mode.warm_up(self.saved)
    self.saved = None
    return (f"sync mode {self.run.sync.mode}, {jax.process_count()} processes (one replica "
            "each)")

  def step(self, step: int) -> executor_lib.StepResult:
    """This replica's next update (see module doc)."""
    del step
    t0 = time.perf_counter()
    terms, samples, scalars = self.mode.update()
    budget = self.run.steps * self.run.batch_size
    if samples >= budget:
      self.mode.finish()             # the coordinator's end: rounds that only hand out state
      self.finished = True
    elif self.mode.done:             # the end came without this replica in the last rounds
      samples, self.finished = budget, True
    loss, accuracy = replica_modes.replica_loss(terms)
    metrics = {} if loss is None else {"loss": loss, "accuracy": accuracy}
    metrics["loss_scale"] = scalars.pop("train/loss_scale", None)
    delta, self.seen = samples - self.seen, samples
    return executor_lib.StepResult(metrics, time.perf_counter() - t0,
                                   dict(scalars, **{"sync/samples": samples}), samples=delta,
                                   checkpoint=self.mode.checkpoint(self.finished),
                                   stop=self.mode.stopping)

  def evaluate(self) -> dict:
    """{} before the end (a copy of the parameters was kept where the mode says); at the end,
    validates every process's copies (the curve) and returns the final parameters'."""
    if not self.finished:
      return {}
    self._validate_snapshots()
    return steps_lib.evaluate(self.local, self.state.params, self.eval_batches, self.plan)

  def _validate_snapshots(self) -> None:
    """Validates every process's kept copies and adds them to the curve (the same on every
    process: gathered through the key-value store); call on every process together."""
    mine = []
    for elapsed, samples, params in self.snapshots:
      params = jax.tree.map(lambda x, s: jax.device_put(x, s), params,
                            self.local.param_shardings)
      val = steps_lib.evaluate(self.local, params, self.eval_batches, self.plan)
      mine.append([elapsed, samples, val["val/loss"], val["val/accuracy"]])
    self.snapshots = []
    every = real_lib.new_store().gather("eval", mine)
    self.curve = sorted(self.curve + [p for points in every for p in points],
                        key=lambda p: (p[1], p[0]))

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> None:
    """Every process at once (local_sgd: the same step; ssaw / async: a cut or the end): the
    global parameters as the train state (the same on every process then), the mode's host
    state (local_sgd's replicas), and in the meta the curve so far (validated now), the
    records, each process's update count and the mode's facts (the coordinator's resume
    point)."""
    self._validate_snapshots()
    base, layout = self.base, self.layout
    host = self.mode.state_dict(layout)
    every = real_lib.new_store().gather("save", dict(self.mode.own(),
                                                     updates=meta["data_position"]))
    logical = base.engine.to_logical(_rehome(self.state, base.engine.state_shardings(
        self.state.params)), layout)
    meta = dict(meta, layout=layout.to_json(), sync_mode=self.run.sync.mode,
                processes=jax.process_count(),
                sync=dict(self.mode.shared(), curve=self.curve, records=self.mode.records(),
                          processes=every))
    extra = dict(base.balancer.state_dict() or {})
    if host is not None:
      extra["sync"] = host
    ckpt.save(step, logical, meta, extra or None)

  def summary(self, base: dict) -> executor_lib.Finish:
    """The sync keys; process 0 writes the rounds and the curve to workdir/sync_rounds.json."""
    run, rounds = self.run, self.mode.rounds()      # (waits for the coordinator's end)
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, ROUNDS_NAME), "w") as f:
        json.dump({"mode": run.sync.mode, "rounds": rounds, "curve": self.curve}, f)
    total = rounds[-1]["elapsed_s"] if rounds else 0.0
    return executor_lib.Finish(
        {"sync": {"mode": run.sync.mode, "updates": len(rounds), "samples": self.seen,
                  "curve": self.curve, "rounds": rounds, **self.mode.summary()}},
        before_val=f", {self.seen} samples in {total:.1f} s")
