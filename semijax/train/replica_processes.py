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
seconds) to workdir/sync_rounds.json. These runs keep no checkpoints yet (the in-flight state
lives in several processes); a run in a workdir that holds one is refused.
"""

from __future__ import annotations

import json
import os
import time
import weakref

import jax
import numpy as np

from semijax.core import engine as engine_lib
from semijax.errors import ConfigError
from semijax.sync import real as real_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import executor as executor_lib
from semijax.train import replica_modes
from semijax.train import steps as steps_lib


ROUNDS_NAME = "sync_rounds.json"


# {the job's engine: this process's replica engine}: runs of one engine share it (and the
# compiled programs hanging off it).
_LOCAL: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AVERAGERS: dict = {}


def _local_engine(engine: engine_lib.Engine) -> engine_lib.Engine:
  if engine not in _LOCAL:
    _LOCAL[engine] = engine_lib.Engine(engine.model_fn, engine.loss_terms,
                                       real_lib.local_mesh(engine.mesh), engine.tx)
  return _LOCAL[engine]


def _local_state(state: engine_lib.TrainState, local: engine_lib.Engine):
  """This process's copy of a global state replicated over `data`, on its local mesh."""
  shardings = local.state_shardings(state.params)
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
    self.plan = self.local.plan(run.layout)
    self.mode = (_LocalSGD if run.sync.mode == "local_sgd" else _Rounds)(self)
    self.state, self.programs = None, None
    self.snapshots: list = []       # (seconds, samples, host params) this process kept
    self.seen = 0                   # the run's samples applied as of this replica's last step
    self.finished = False
    self.curve: list = []

  def close(self) -> None:
    """Nothing of its own: the wrapped executor is closed by whoever built it."""

  def init(self, seed: int) -> None:
    self.base.init(seed)
    self.state = _local_state(self.base.state, self.local)

  def restore(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> tuple[int, str]:
    raise ConfigError(f"--workdir: it holds a checkpoint (step {step}); multi-process "
                      f"sync.mode {self.run.sync.mode!r} runs do not resume yet: use a new "
                      "workdir")

  def warm_up(self, step: int) -> str:
    """Compiles this replica's programs and the collectives among the processes."""
    del step
    self.programs = replica_modes.programs_for(self.local, self.run.sync).bind(self.state)
    self.mode.warm_up()
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
    delta, self.seen = samples - self.seen, samples
    return executor_lib.StepResult(metrics, time.perf_counter() - t0,
                                   dict(scalars, **{"sync/samples": samples}), samples=delta)

  def evaluate(self) -> dict:
    """{} before the end (a copy of the parameters was kept where the mode says); at the end,
    validates every process's copies (the curve) and returns the final parameters'."""
    if not self.finished:
      return {}
    self.curve = self._evaluate_snapshots()
    return steps_lib.evaluate(self.local, self.state.params, self.eval_batches, self.plan)

  def _evaluate_snapshots(self) -> list:
    """[[seconds, samples, val loss, val accuracy]] of every process's snapshots, sorted by
    samples (gathered through the key-value store)."""
    store = real_lib.new_store()
    mine = []
    for elapsed, samples, params in self.snapshots:
      params = jax.tree.map(lambda x, s: jax.device_put(x, s), params,
                            self.local.param_shardings)
      val = steps_lib.evaluate(self.local, params, self.eval_batches, self.plan)
      mine.append([elapsed, samples, val["val/loss"], val["val/accuracy"]])
    store.set(f"eval/{jax.process_index()}", json.dumps(mine))
    store.barrier("evaluated")
    curve = [p for v in store.dir("eval/").values() for p in json.loads(v)]
    return sorted(curve, key=lambda p: (p[1], p[0]))

  def save(self, ckpt: checkpoint_lib.Checkpointer, step: int, meta: dict) -> None:
    """Nothing yet (see module doc)."""
    del ckpt, step, meta

  def summary(self, base: dict) -> executor_lib.Finish:
    """The sync keys; process 0 writes the rounds and the curve to workdir/sync_rounds.json."""
    run, rounds = self.run, self.mode.rounds()
    if jax.process_index() == 0:
      with open(os.path.join(self.workdir, ROUNDS_NAME), "w") as f:
        json.dump({"mode": run.sync.mode, "rounds": rounds, "curve": self.curve}, f)
    total = rounds[-1]["elapsed_s"] if rounds else 0.0
    return executor_lib.Finish(
        {"sync": {"mode": run.sync.mode, "updates": len(rounds), "samples": self.seen,
                  "curve": self.curve, "rounds": rounds, **self.mode.summary()}},
        before_val=f", {self.seen} samples in {total:.1f} s")


class _Rounds:
  """ssaw / async over processes: an update is the next round this replica is in."""

  def __init__(self, ex: ProcessReplicas):
    self.ex, self.coordinator, self.replica, self.groups = ex, None, None, None
    self.started = False

  @property
  def done(self) -> bool:
    return self.replica.done

  def warm_up(self) -> None:
    ex, run = self.ex, self.ex.run
    r, local, programs = run.mesh.data, ex.local, ex.programs
    store = real_lib.new_store()
    if local not in _GROUPS:
      _GROUPS[local] = real_lib.GroupPrograms(local, ex.base.engine.mesh, ex.state)
    self.groups = _GROUPS[local]
    batch = local.shard_batch(ex.batches.microbatch(0))
    scratch, _ = programs.compute(ex.state.params, programs.zeros(ex.state.params), batch,
                                  ex.plan, np.ones(1, bool))
    self.groups.warm_up(ex.state, scratch, r)
    if jax.process_index() == 0:
      self.coordinator = real_lib.Coordinator(
          store, run.sync, r, batch_size=run.batch_size, total_microbatches=run.steps * r,
          learning_rate=replica_modes.learning_rate_fn(run),
          eval_every_samples=run.eval_every * run.batch_size)
    self.replica = real_lib.RoundsReplica(store, programs, self.groups, ex.plan,
                                          total_microbatches=run.steps * r,
                                          microbatch_samples=run.batch_size // r)

  def update(self) -> tuple[dict | None, int, dict]:
    """(this replica's gradient's loss terms or None, the run's samples after the round, the
    round's scalars); on the coordinator's end, (None, the samples seen, {})."""
    ex = self.ex
    if not self.started:              # every process is warm (the loop waited for them)
      self.started = True
      if self.coordinator is not None:
        self.coordinator.start()
    ex.state, msg, terms = self.replica.next_round(ex.state, ex.batches.microbatch)
    if msg is None:
      return None, ex.seen, {}
    if msg.snapshot and msg.source == jax.process_index():
      ex.snapshots.append((msg.elapsed_s, msg.samples, jax.device_get(ex.state.params)))
    return terms, msg.samples, {"sync/elapsed_s": msg.elapsed_s,
                                "sync/members": len(msg.members),
                                "sync/max_staleness": max(msg.staleness)}

  def finish(self) -> None:
    ex = self.ex
    while not self.replica.done:
      ex.state, _, _ = self.replica.next_round(ex.state, ex.batches.microbatch)

  def rounds(self) -> list:
    if self.coordinator is None:
      return []
    self.coordinator.join()
    return [{"version": m.version, "elapsed_s": m.elapsed_s, "samples": m.samples,
             "members": list(m.members), "staleness": list(m.staleness),
             "microbatches": list(m.microbatches)}
            for m in self.coordinator.rounds if not m.done]

  def summary(self) -> dict:
    return {"computed": self.replica.computed, "compiled_groups": self.groups.compiled}


class _LocalSGD:
  """local_sgd over processes: an update is one local step of this replica on its microbatch;
  every `local_steps` steps and at the end, one all-reduce of the parameters and the outer
  step."""

  def __init__(self, ex: ProcessReplicas):
    self.ex, self.k, self.start = ex, 0, None
    self.next_eval = ex.run.eval_every
    self.params = self.replicas = self.momentum = self.averager = None
    self.records: list = []

  @property
  def done(self) -> bool:
    return self.k >= self.ex.run.steps

  def warm_up(self) -> None:
    ex, run = self.ex, self.ex.run
    key = (ex.local, run.sync.outer, run.sync.outer_lr, run.sync.outer_momentum)
    if key not in _AVERAGERS:
      _AVERAGERS[key] = real_lib.Averager(ex.local, ex.base.engine.mesh, run.sync)
    self.averager = _AVERAGERS[key]
    self.params = ex.state.params
    self.replicas = ex.programs.stack(ex.state)
    self.momentum = jax.tree.map(lambda x: x * 0.0, self.params)
    copy = lambda t: jax.tree.map(lambda x: x.copy(), t)
    batch = ex.local.shard_batch(ex.batches.microbatch(jax.process_index()))
    scratch, _ = ex.programs.local(copy(self.replicas), batch, ex.plan)
    jax.block_until_ready(self.averager(copy(self.params), scratch.params, copy(self.momentum)))

  def update(self) -> tuple[dict, int, dict]:
    ex, run, me = self.ex, self.ex.run, jax.process_index()
    if self.start is None:
      self.start = time.perf_counter()
    k, r = self.k, run.mesh.data
    batch = ex.local.shard_batch(ex.batches.microbatch(k * r + me))
    self.replicas, terms = ex.programs.local(self.replicas, batch, ex.plan)
    terms = jax.device_get(terms)
    self.k = step = k + 1
    outer = step % run.sync.local_steps == 0 or step == run.steps
    if outer:
      self.params, self.momentum = self.averager(self.params, self.replicas.params,
                                                 self.momentum)
      self.replicas = engine_lib.TrainState(jax.tree.map(real_lib.stack1, self.params),
                                            self.replicas.opt_state)
      if me == 0 and (step >= self.next_eval or step == run.steps):
        ex.snapshots.append((time.perf_counter() - self.start, step * run.batch_size,
                             jax.device_get(self.params)))
      while self.next_eval <= step:
        self.next_eval += run.eval_every
    jax.block_until_ready(self.replicas)
    ex.state = engine_lib.TrainState(self.params, ex.state.opt_state)
    elapsed = time.perf_counter() - self.start
    self.records.append({"version": step, "elapsed_s": elapsed,
                         "samples": step * run.batch_size})
    return terms, step * run.batch_size, {"sync/elapsed_s": elapsed, "sync/outer": float(outer)}

  def finish(self) -> None:
    pass

  def rounds(self) -> list:
    return self.records

  def summary(self) -> dict:
    return {}
