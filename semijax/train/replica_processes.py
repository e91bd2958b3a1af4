"""The replica modes with one replica per process (several processes joined by jax.distributed).

`loop.train_and_evaluate` hands a multi-process run of `config.sync.mode` ssaw, async or
local_sgd here. Each process trains its replica on its own devices (a local mesh: its row of the
(data, tensor) mesh) and the replicas combine as `semijax.sync.real` describes: ssaw / async in
rounds decided by a coordinator thread in process 0 and applied by collectives among each
round's members; local_sgd with one all-reduce of the parameters every `local_steps` steps.

The clock is the wall clock (real speeds, e.g. a competing process on one core). Validation runs
after training on the copies of the parameters kept when the samples applied crossed a multiple
of eval_every x batch_size, so it never delays a replica; the summary's "sync"/"curve" pairs each
with the seconds since the start at which it existed. Metrics are written by process 0 for the
rounds it is in, and it writes every round (members, staleness, microbatches, seconds) to
workdir/sync_rounds.json. These runs keep no checkpoints yet (the in-flight state lives in
several processes); a run in a workdir that holds one is refused.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from typing import Callable

import jax
import numpy as np

from semijax.core import engine as engine_lib
from semijax.errors import ConfigError
from semijax.sync import real as real_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import metrics as metrics_lib
from semijax.train import replica_modes
from semijax.train import steps as steps_lib


ROUNDS_NAME = "sync_rounds.json"


say = metrics_lib.say


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


def train(run: config_lib.RunConfig, engine: engine_lib.Engine, writer, state, start: int, *,
          after_warmup: Callable[[], None] | None, evaluate: Callable) -> dict:
  """Trains this process's replica to the end of the sample budget; returns the summary (the
  full one on process 0)."""
  if start:
    raise ConfigError(f"--workdir: it holds a checkpoint (step {start}); multi-process "
                      f"sync.mode {run.sync.mode!r} runs do not resume yet: use a new workdir")
  local = _local_engine(engine)
  lstate = _local_state(state, local)
  dataset = data_lib.build(run.data, 0, 1)       # any process may claim any microbatch
  batches = replica_modes.Batches(dataset, run.mesh.data)
  eval_batches = [local.shard_batch(b) for b in dataset.eval_batches()]
  plan = local.plan(run.layout)
  programs = replica_modes.programs_for(local, run.sync).bind(lstate)
  runner = (_local_sgd if run.sync.mode == "local_sgd" else _rounds)
  t0 = time.perf_counter()
  out = runner(run, engine.mesh, local, programs, plan, batches, lstate, after_warmup, t0)
  final_params, snapshots, records = out
  curve = _evaluate_snapshots(local, snapshots, eval_batches, plan, evaluate)
  val = evaluate(local, final_params, eval_batches, plan)
  return _summary(run, writer, records, curve, val)


def _warm_start(run, after_warmup, t0) -> None:
  """Every process finished compiling: start together."""
  steps_lib.start_together("semijax replicas warm-up")
  say(f"warm-up: sync mode {run.sync.mode}, {jax.process_count()} processes (one replica "
      f"each), {time.perf_counter() - t0:.1f} s")
  if after_warmup is not None:
    after_warmup()


def _rounds(run, global_mesh, local, programs, plan, batches, lstate, after_warmup, t0):
  """ssaw / async: (final params, snapshots, per-round records)."""
  r = run.mesh.data
  store = real_lib.new_store()
  if local not in _GROUPS:
    _GROUPS[local] = real_lib.GroupPrograms(local, global_mesh, lstate)
  groups = _GROUPS[local]
  batch = local.shard_batch(batches.microbatch(0))
  scratch, _ = programs.compute(lstate.params, programs.zeros(lstate.params), batch, plan,
                                np.ones(1, bool))
  groups.warm_up(lstate, scratch, r)
  coordinator = None
  if jax.process_index() == 0:
    coordinator = real_lib.Coordinator(
        store, run.sync, r, batch_size=run.batch_size, total_microbatches=run.steps * r,
        learning_rate=replica_modes.learning_rate_fn(run),
        eval_every_samples=run.eval_every * run.batch_size)
  _warm_start(run, after_warmup, t0)
  if coordinator is not None:
    coordinator.start()
  replica = real_lib.RoundsReplica(store, programs, groups, plan,
                                   total_microbatches=run.steps * r,
                                   microbatch_samples=run.batch_size // r)
  snapshots, records = [], []
  me = jax.process_index()

  def on_round(msg, state, terms):
    if msg.snapshot and msg.source == me:
      snapshots.append((msg.elapsed_s, msg.samples, jax.device_get(state.params)))
    loss = None if terms is None else float(terms["loss_sum"].sum() / terms["count"].sum())
    records.append({"version": msg.version, "elapsed_s": msg.elapsed_s, "samples": msg.samples,
                    "loss": loss, "members": len(msg.members),
                    "max_staleness": max(msg.staleness)})

  state = replica.run(lstate, batches.microbatch, on_round)
  if coordinator is not None:
    coordinator.join()
    rounds = coordinator.rounds
    records = {"rounds": [{"version": m.version, "elapsed_s": m.elapsed_s, "samples": m.samples,
                           "members": list(m.members), "staleness": list(m.staleness),
                           "microbatches": list(m.microbatches)}
                          for m in rounds if not m.done], "mine": records}
  else:
    records = {"rounds": [], "mine": records}
  records["computed"] = replica.computed
  records["compiled_groups"] = groups.compiled
  return state.params, snapshots, records


def _local_sgd(run, global_mesh, local, programs, plan, batches, lstate, after_warmup, t0):
  """local_sgd: (final params, snapshots, per-step records)."""
  r, me = run.mesh.data, jax.process_index()
  key = (local, run.sync.outer, run.sync.outer_lr, run.sync.outer_momentum)
  if key not in _AVERAGERS:
    _AVERAGERS[key] = real_lib.Averager(local, global_mesh, run.sync)
  averager = _AVERAGERS[key]
  params = lstate.params
  replicas = programs.stack(lstate)
  momentum = jax.tree.map(lambda x: x * 0.0, params)
  copy = lambda t: jax.tree.map(lambda x: x.copy(), t)
  scratch, _ = programs.local(copy(replicas), local.shard_batch(batches.microbatch(me)), plan)
  jax.block_until_ready(averager(copy(params), scratch.params, copy(momentum)))
  _warm_start(run, after_warmup, t0)
  start = time.perf_counter()
  snapshots, records = [], []
  next_eval = run.eval_every
  for k in range(run.steps):
    batch = local.shard_batch(batches.microbatch(k * r + me))
    replicas, terms = programs.local(replicas, batch, plan)
    terms = jax.device_get(terms)
    step = k + 1
    outer = step % run.sync.local_steps == 0 or step == run.steps
    if outer:
      params, momentum = averager(params, replicas.params, momentum)
      replicas = engine_lib.TrainState(jax.tree.map(real_lib.stack1, params),
                                       replicas.opt_state)
      if me == 0 and (step >= next_eval or step == run.steps):
        snapshots.append((time.perf_counter() - start, step * run.batch_size,
                          jax.device_get(params)))
      while next_eval <= step:
        next_eval += run.eval_every
    jax.block_until_ready(replicas)
    records.append({"version": step, "elapsed_s": time.perf_counter() - start,
                    "samples": step * run.batch_size,
                    "loss": float(terms["loss_sum"].sum() / terms["count"].sum())})
  rounds = [{"version": x["version"], "elapsed_s": x["elapsed_s"], "samples": x["samples"]}
            for x in records]
  return params, snapshots, {"rounds": rounds, "mine": records}


def _evaluate_snapshots(local, snapshots, eval_batches, plan, evaluate) -> list:
  """[[seconds, samples, val loss, val accuracy]] of every process's snapshots, sorted by
  samples (gathered through the key-value store)."""
  store = real_lib.new_store()
  mine = []
  for elapsed, samples, params in snapshots:
    params = jax.tree.map(lambda x, s: jax.device_put(x, s), params, local.param_shardings)
    val = evaluate(local, params, eval_batches, plan)
    mine.append([elapsed, samples, val["val/loss"], val["val/accuracy"]])
  store.set(f"eval/{jax.process_index()}", json.dumps(mine))
  store.barrier("evaluated")
  curve = [p for v in store.dir("eval/").values() for p in json.loads(v)]
  return sorted(curve, key=lambda p: (p[1], p[0]))


def _summary(run, writer, records, curve, val) -> dict:
  unit = run.model.unit
  rounds = records["rounds"]
  elapsed = [x["elapsed_s"] for x in rounds]
  times = np.diff([0.0] + elapsed).tolist()
  total = elapsed[-1] if elapsed else 0.0
  samples = rounds[-1]["samples"] if rounds else 0
  losses = [x["loss"] for x in records["mine"] if x["loss"] is not None]
  for x in records["mine"]:
    if x["loss"] is not None:
      writer.write(x["version"], {"train/loss": x["loss"], "sync/samples": x["samples"],
                                  "sync/elapsed_s": x["elapsed_s"]})
  if rounds:
    writer.write(rounds[-1]["version"], {**val, "sync/samples": samples})
  if jax.process_index() == 0:
    with open(os.path.join(writer.workdir, ROUNDS_NAME), "w") as f:
      json.dump({"mode": run.sync.mode, "rounds": rounds, "curve": curve}, f)
  items = samples * run.model.items_per_example
  summary = {"steps": len(rounds), "start_step": 0,
             "train/loss": losses[-1] if losses else float("nan"), **val,
             "mean_step_time_s": float(np.mean(times)) if times else float("nan"),
             f"{unit}_per_s": items / total if total else 0.0, "step_times_s": times,
             "losses": losses,
             "sync": {"mode": run.sync.mode, "updates": len(rounds), "samples": samples,
                      "curve": curve, "rounds": rounds,
                      "computed": records.get("computed"),
                      "compiled_groups": records.get("compiled_groups")}}
  say(f"done: {len(rounds)} updates, {samples} samples in {total:.1f} s, "
      f"{summary[f'{unit}_per_s']:,.0f} {unit}/s, val_loss {val['val/loss']:.4f}")
  return summary
