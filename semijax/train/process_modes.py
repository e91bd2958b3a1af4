"""What one update is for a replica with one process of its own (`replica_processes`): the
drivers `Rounds` (ssaw, async: the next round this replica is in, decided by the coordinator
thread of process 0) and `LocalSGD` (one local step; every `local_steps` steps and at the end,
one all-reduce of the parameters among the processes and the outer step), after
`semijax.sync.real`.

Each driver reads and writes its executor's state (`ex.state`, the replica's local padded
`TrainState`), its batches, programs and snapshots. `LocalSGD` also gives the state a checkpoint
keeps (`state_dict`: every process's replica, gathered, and the outer momentum, as host logical
copies in the layout of one-process local SGD, `replica_modes.LocalSGD`) and loads it back.
"""

from __future__ import annotations

import dataclasses
import time
import weakref

import jax
import numpy as np
from jax.experimental import multihost_utils

from semijax.core import engine as engine_lib
from semijax.core import loss_scale
from semijax.sync import real as real_lib
from semijax.train import replica_modes


# {this process's replica engine: its group programs}; {(engine, outer optimizer): averager}:
# runs of one engine share them (and their compiled programs).
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_AVERAGERS: dict = {}


class Rounds:
  """ssaw / async over processes: an update is the next round this replica is in. The
  processes do not step together; they save together at a cut (`real.Message.checkpoint`: a
  round of every replica, after which none holds a gradient and all hold the same state), which
  the coordinator makes once the samples applied reach a multiple of checkpoint_every x
  batch_size, and at the end. A resumed run's coordinator starts at the cut's version and
  samples, its microbatch counter at the microbatches applied (all were, at a cut). A process
  that heard a SIGTERM (`ex.preemption`) asks the coordinator to stop; the next round is a cut
  after which every process saves and stops (`stopping`)."""

  steps_together = False

  def __init__(self, ex):
    self.ex, self.coordinator, self.replica, self.groups = ex, None, None, None
    self.started = False
    self.cut = None                 # the version of the cut the last update applied, if one
    self.stopping = False           # that cut is the one the run stops at
    self.before: list = []          # the records of the rounds before a resume (process 0)
    self.store, self._asked = None, False

  @property
  def done(self) -> bool:
    return self.replica.done

  def warm_up(self, saved: dict | None) -> None:
    ex, run = self.ex, self.ex.run
    r, local, programs = run.mesh.data, ex.local, ex.programs
    self.store = store = real_lib.new_store()
    if local not in _GROUPS:
      _GROUPS[local] = real_lib.GroupPrograms(local, ex.base.engine.mesh, ex.state)
    self.groups = _GROUPS[local]
    batch = local.shard_batch(ex.batches.microbatch(0))
    scratch, _ = programs.compute(ex.state, programs.zeros(ex.state.params), batch,
                                  ex.plan, np.ones(1, bool))
    self.groups.warm_up(ex.state, scratch, r)
    resume, computed = real_lib.Resume(), ()
    if saved is not None:
      resume = real_lib.Resume(**saved["meta"]["coordinator"])
      computed, self.before = saved["mine"]["computed"], list(saved["meta"]["records"])
    microbatch_samples = run.batch_size // r
    if jax.process_index() == 0:
      store.increment("claim", resume.applied // microbatch_samples)   # before any claim
      self.coordinator = real_lib.Coordinator(
          store, run.sync, r, batch_size=run.batch_size, total_microbatches=run.steps * r,
          learning_rate=replica_modes.learning_rate_fn(run),
          eval_every_samples=run.eval_every * run.batch_size,
          checkpoint_every_samples=run.checkpoint_every * run.batch_size, resume=resume)
    self.replica = real_lib.RoundsReplica(store, programs, self.groups, ex.plan,
                                          total_microbatches=run.steps * r,
                                          microbatch_samples=microbatch_samples,
                                          version=resume.version, computed=computed)

  def update(self) -> tuple[dict | None, int, dict]:
    """(this replica's gradient's loss terms or None, the run's samples after the round, the
    round's scalars); on the coordinator's end, (None, the samples seen, {})."""
    ex = self.ex
    if not self.started:              # every process is warm (the loop waited for them)
      self.started = True
      if self.coordinator is not None:
        self.coordinator.start()
    if ex.preemption is not None and ex.preemption.requested and not self._asked:
      self.store.set("stop", str(jax.process_index()))
      self._asked = True
    scale = loss_scale.scale_of(ex.state.opt_state)    # what this replica's gradient is taken at
    ex.state, msg, terms = self.replica.next_round(ex.state, ex.batches.microbatch)
    self.cut = None
    if msg is None:
      return None, ex.seen, {}
    if msg.checkpoint:
      self.cut, self.stopping = msg.version, msg.stop
    if msg.snapshot and msg.source == jax.process_index():
      ex.snapshots.append((msg.elapsed_s, msg.samples, jax.device_get(ex.state.params)))
    scalars = {"sync/elapsed_s": msg.elapsed_s, "sync/members": len(msg.members),
               "sync/max_staleness": max(msg.staleness)}
    if scale is not None:
      scalars["train/loss_scale"] = float(scale)
    return terms, msg.samples, scalars

  def finish(self) -> None:
    ex = self.ex
    while not self.replica.done:
      ex.state, _, _ = self.replica.next_round(ex.state, ex.batches.microbatch)

  def checkpoint(self, finished: bool) -> int | None:
    """The id to save under after this update: the end's version once the run is over (every
    process holds the final state), a cut's version, or None."""
    return self.replica.end.version if finished else self.cut

  def records(self) -> list:
    """The rounds published so far (process 0; [] elsewhere), without waiting."""
    if self.coordinator is None:
      return []
    return self.before + [_record(m) for m in list(self.coordinator.rounds) if not m.done]

  def rounds(self) -> list:
    """Every round of the run, once the coordinator has ended."""
    if self.coordinator is not None:
      self.coordinator.join()
    return self.records()

  def own(self) -> dict:
    return {"computed": list(self.replica.computed)}

  def shared(self) -> dict:
    """The coordinator's resume point (process 0's: the one the meta keeps)."""
    point = real_lib.Resume() if self.coordinator is None else self.coordinator.resume_point()
    return {"coordinator": dataclasses.asdict(point)}

  def summary(self) -> dict:
    return {"computed": self.replica.computed, "compiled_groups": self.groups.compiled}

  def state_dict(self, layout) -> None:
    """Nothing beyond the parameters: at a cut no gradient is in flight."""
    del layout


def _record(m: real_lib.Message) -> dict:
  return {"version": m.version, "elapsed_s": m.elapsed_s, "samples": m.samples,
          "members": list(m.members), "staleness": list(m.staleness),
          "microbatches": list(m.microbatches)}


class LocalSGD:
  """local_sgd over processes: an update is one local step of this replica on its microbatch;
  every `local_steps` steps and at the end, one all-reduce of the parameters and the outer
  step. The processes step in lockstep, so they save the same checkpoints together."""

  steps_together = True
  stopping = False                 # (a SIGTERM stops it through the loop)

  def __init__(self, ex):
    self.ex, self.k = ex, 0
    self.next_eval = ex.run.eval_every
    self.params = self.replicas = self.momentum = self.averager = None
    self.log: list = []             # a record per local step
    self.start, self.elapsed_before = None, 0.0   # the clock; seconds before a resume

  @property
  def done(self) -> bool:
    return self.k >= self.ex.run.steps

  def warm_up(self, saved: dict | None) -> None:
    """Compiles the local step and the outer step (on copies), then starts from the run's
    state or continues the checkpoint's (`saved`: "host", `state_dict`'s arrays; "meta", the
    meta's "sync" facts)."""
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
    if saved is not None:
      self._load(saved["host"], saved["meta"]["records"])

  def update(self) -> tuple[dict, int, dict]:
    ex, run, me = self.ex, self.ex.run, jax.process_index()
    if self.start is None:
      self.start = time.perf_counter() - self.elapsed_before
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
    self.log.append({"version": step, "elapsed_s": elapsed,
                         "samples": step * run.batch_size})
    scalars = {"sync/elapsed_s": elapsed, "sync/outer": float(outer)}
    if "loss_scale" in terms:            # the scale this replica's local step used
      scalars["train/loss_scale"] = float(np.min(terms.pop("loss_scale")))
    return terms, step * run.batch_size, scalars

  def finish(self) -> None:
    pass

  def checkpoint(self, finished: bool) -> None:
    """None: the loop's cadence decides (the processes step together)."""
    del finished

  def records(self) -> list:
    return self.log

  def rounds(self) -> list:
    return self.log

  def own(self) -> dict:
    return {}

  def shared(self) -> dict:
    return {}

  def summary(self) -> dict:
    return {}

  def state_dict(self, layout) -> dict:
    """{"step", "replicas": every process's replica (params and optimizer state) as flat host
    logical arrays [R, *L], "momentum": the outer momentum [*L], "next_eval", "elapsed_s"};
    the same on every process (the replicas are gathered, a collective). The center
    parameters are the checkpoint's train state."""
    forms = self.ex.programs.forms
    mine = forms.to_host(self.replicas, layout)                 # {leaf: [1, *L]}
    every = multihost_utils.process_allgather(mine, tiled=True)   # {leaf: [R, *L]}
    elapsed = 0.0 if self.start is None else time.perf_counter() - self.start
    return {"step": np.int64(self.k), "replicas": every,
            "momentum": forms.to_host(self.momentum, layout, leading=0),
            "next_eval": np.int64(self.next_eval),
            "elapsed_s": np.float64(multihost_utils.broadcast_one_to_all(elapsed))}

  def _load(self, saved: dict, records: list) -> None:
    ex, me = self.ex, jax.process_index()
    forms, layout = ex.programs.forms, ex.layout
    mine = {leaf: x[me:me + 1] for leaf, x in saved["replicas"].items()}
    self.replicas = forms.to_device(mine, self.replicas, layout,
                                    ex.programs.stacked_state_shardings())
    self.momentum = forms.to_device(saved["momentum"], self.momentum, layout,
                                    ex.local.param_shardings, leading=0)
    self.k, self.next_eval = int(saved["step"]), int(saved["next_eval"])
    self.elapsed_before = float(saved["elapsed_s"])
    self.log = list(records)
