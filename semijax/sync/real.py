"""Replicas in separate processes: ssaw / async rounds and local SGD over `jax.distributed`.

Multi-controller JAX runs a collective only when every process whose devices it spans enters it,
in the same order. A replica that is still computing cannot enter an all-reduce, so semi-
synchrony cannot use one all-reduce over every replica per update. Here each process is one
replica (its local devices are its tensor group, the `tensor` axis of a local mesh) and:

  * control goes through the `jax.distributed` key-value store (the coordination service every
    multi-process job already runs): an atomic counter hands out microbatches, each replica
    posts "ready" (its gradient is computed) under the next number of a shared post counter,
    and a small coordinator thread in process 0, waiting on the next post (a blocking read that
    costs no CPU), applies the round rule (`timeline`'s: first fresh arrival, grace, staleness
    bound) to those posts on the wall clock and publishes each round: its members, their
    weights (`weights.combine`) and learning-rate factor;
  * data goes through collectives over the round's *members only*: a program on the mesh of
    their devices (`GroupPrograms`), the weighted sum of their gradients (an all-reduce among
    them) and the optimizer update, which every member computes and keeps. A member that missed
    rounds (it was computing) gets the current parameters and optimizer state from an up-to-date
    member in the same program (the "join" variant: one more all-reduce of the state). A round
    of one replica is a program on its own devices: no communication at all;
  * a replica that is not a member of a round never waits for it: it reads the round's message
    (blocking only when its own gradient is ready and it needs the next round to apply it).

Checkpoints need a state every process holds: once the samples applied reach a multiple of
`checkpoint_every_samples`, the coordinator waits for every replica and publishes a round of all
of them (a *cut*, `Message.checkpoint`); after it no gradient is in flight and every member
holds the same state. A resumed coordinator starts from the cut (`Resume`).

local_sgd needs none of this: every process takes `local_steps` local steps on its own devices,
then all enter one all-reduce of the parameters (the outer step), in lockstep.

What this needs from a cluster beyond synchronous data parallelism: collectives over subsets of
the processes (a communicator per member set: NCCL or gloo groups, created on first use), the
key-value store's latency on every round (a few small messages), and memory for one in-flight
gradient per replica. The coordinator is one thread; it reads and writes only small messages.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src import distributed as jax_distributed   # the job's key-value store client
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from semijax.core import engine as engine_lib
from semijax.core import mesh as mesh_lib
from semijax.sync import programs as programs_lib
from semijax.sync import settings as settings_lib
from semijax.sync import weights as weights_lib

_IDLE_MS = 1_000          # the coordinator's longest wait for a post before it looks again
_WAIT_MS = 3_600_000      # the longest a replica waits for the next round's message
_WARM_ALL_SUBSETS = 4     # up to this many replicas, every member set is compiled at warm-up

_runs = itertools.count()  # one key prefix per run in a process (the same on every process)


# --- the key-value store ------------------------------------------------------------------------


class KeyValue:
  """The job's key-value store (`jax.distributed`), under one key prefix."""

  def __init__(self, prefix: str):
    self.client = jax_distributed.global_state.client
    if self.client is None:
      raise RuntimeError("semijax.sync.real: jax.distributed is not initialized")
    self.prefix = prefix

  def set(self, key: str, value: str) -> None:
    self.client.key_value_set(self.prefix + key, value, allow_overwrite=True)

  def get(self, key: str, timeout_ms: int = _WAIT_MS) -> str:
    return self.client.blocking_key_value_get(self.prefix + key, timeout_ms)

  def wait(self, key: str, timeout_ms: int) -> str | None:
    """The value of `key` once it is set, or None after `timeout_ms` (the wait costs no CPU)."""
    try:
      return self.client.blocking_key_value_get(self.prefix + key, max(1, int(timeout_ms)))
    except jax.errors.JaxRuntimeError as e:
      if "DEADLINE_EXCEEDED" not in str(e):
        raise
      return None

  def try_get(self, key: str) -> str | None:
    """The value of `key`, or None if it is not set (does not wait)."""
    try:
      return self.client.key_value_try_get(self.prefix + key)
    except jax.errors.JaxRuntimeError as e:
      if "NOT_FOUND" not in str(e):
        raise
      return None

  def dir(self, key: str) -> dict[str, str]:
    return {k[len(self.prefix + key):]: v
            for k, v in self.client.key_value_dir_get(self.prefix + key)}

  def increment(self, key: str, by: int = 1) -> int:
    return int(self.client.key_value_increment(self.prefix + key, by))

  def barrier(self, name: str, timeout_ms: int = 600_000) -> None:
    self.client.wait_at_barrier(self.prefix + name, timeout_ms)

  def gather(self, name: str, value) -> list:
    """Every process's JSON-able `value`, in process order (call on every process)."""
    self.set(f"{name}/{jax.process_index()}", json.dumps(value))
    self.barrier(name)
    values = self.dir(f"{name}/")
    return [json.loads(values[str(i)]) for i in range(len(values))]


def new_store() -> KeyValue:
  """A store for the next run of this process (runs number themselves in the same order on
  every process)."""
  return KeyValue(f"semijax/sync/{next(_runs)}/")


# --- one round, as published ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Message:
  """A round, as the coordinator publishes it (JSON).

  Attributes:
    version: the version the round makes. members: the replicas in it (ascending).
    weights: per member, the weight of its gradient (0 for a member with none).
    lr_factor: the factor on the optimizer's scheduled step.
    source: an up-to-date member; join: whether some member needs its state.
    samples: samples applied after this round. elapsed_s: wall seconds since the start.
    snapshot: whether the source keeps a copy of the parameters for evaluation.
    staleness: per member (0 for none). microbatches: per member (-1 for none).
    done: no more rounds.
    checkpoint: a cut: every replica is a member and none holds a gradient after it, so all
      hold the same state and save it together.
    stop: a cut after which every replica saves and stops (a process was asked to stop: key
      "stop" in the store); no round follows.
  """

  version: int = 0
  members: tuple = ()
  weights: tuple = ()
  lr_factor: float = 1.0
  source: int = 0
  join: bool = False
  samples: int = 0
  elapsed_s: float = 0.0
  snapshot: bool = False
  staleness: tuple = ()
  microbatches: tuple = ()
  done: bool = False
  checkpoint: bool = False
  stop: bool = False

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self))

  @classmethod
  def from_json(cls, text: str) -> "Message":
    d = json.loads(text)
    return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


@dataclasses.dataclass(frozen=True)
class Resume:
  """Where a coordinator starts: the version and samples applied at a cut (`Message.checkpoint`),
  the seconds run before it, and the next evaluation and cut thresholds (samples)."""

  version: int = 0
  applied: int = 0
  elapsed_s: float = 0.0
  next_eval: int | None = None
  next_cut: int | None = None


@dataclasses.dataclass
class _Replica:
  """What the coordinator knows of one replica."""

  state_version: int = 0     # the version of its parameters
  started_s: float = 0.0     # when it started its current microbatch
  estimate_s: float | None = None   # its last microbatch's duration
  seq: int = -1              # its last consumed post
  ready: dict | None = None  # an unconsumed post: {"seq", "base", "samples", "at"}


class Coordinator:
  """The round rule on the wall clock, in a thread of process 0 (see module doc).

  Args:
    store: the run's key-value store. settings: mode, grace, staleness bound, weighting.
    num_replicas: R. batch_size: the global batch. total_microbatches: the stream's length.
    microbatch_samples: samples per microbatch. learning_rate: progress -> scheduled rate.
    eval_every_samples: snapshot when the samples applied cross a multiple of this.
    checkpoint_every_samples: once the samples applied reach a multiple of this, the next round
      waits for every replica and is a cut (`Message.checkpoint`); 0: never.
    resume: where a resumed run starts (the cut it saved at).
  """

  def __init__(self, store: KeyValue, settings: settings_lib.SyncSettings, num_replicas: int,
               *, batch_size: int, total_microbatches: int,
               learning_rate: Callable[[float], float], eval_every_samples: int,
               checkpoint_every_samples: int = 0, resume: Resume = Resume()):
    self.store, self.settings = store, settings
    self.num_replicas, self.batch_size = num_replicas, batch_size
    self.total = total_microbatches
    self.learning_rate = learning_rate
    self.eval_every, self.cut_every = eval_every_samples, checkpoint_every_samples
    self.version, self.applied = resume.version, resume.applied
    self.replicas = [_Replica(state_version=resume.version) for _ in range(num_replicas)]
    self.rounds: list[Message] = []     # published by this coordinator (not before a resume)
    self.error: BaseException | None = None
    self._before_s = resume.elapsed_s
    self._t0 = 0.0
    self._open_s = 0.0
    self._next_eval = resume.next_eval or eval_every_samples
    self._next_cut = resume.next_cut or checkpoint_every_samples
    self._stop = False        # a process asked to stop (before the end of the stream)
    self._posts = 0           # posts taken
    self._deadline = None     # the grace deadline the coordinator waits for, if any
    self._thread = threading.Thread(target=self._run, name="semijax-ssaw-coordinator",
                                    daemon=True)

  def start(self) -> None:
    self._open_s = time.perf_counter()
    self._t0 = self._open_s - self._before_s
    for r in self.replicas:
      r.started_s = self._open_s
    self._thread.start()

  def join(self) -> None:
    self._thread.join()
    if self.error is not None:
      raise RuntimeError(f"the ssaw coordinator failed: {self.error!r}") from self.error

  def _run(self) -> None:
    try:
      while True:
        self._read_posts()
        if self._decide():
          return
    except BaseException as e:     # pylint: disable=broad-except
      self.error = e
      self.store.set(f"round/{len(self.rounds) + 1}", Message(done=True).to_json())

  def _read_posts(self) -> None:
    """Waits for the next post (replicas number them with a shared counter), at most until a
    pending grace deadline, then takes every post that is there."""
    wait_ms = _IDLE_MS
    if self._deadline is not None:
      wait_ms = min(wait_ms, 1e3 * (self._deadline - time.perf_counter()))
    value = self.store.wait(f"post/{self._posts}", wait_ms)
    while value is not None:
      self._posts += 1
      self._take(value)
      value = self.store.try_get(f"post/{self._posts}")

  def _take(self, post: str) -> None:
    i, seq, base, samples, microbatch = (int(x) for x in post.split())
    r = self.replicas[i]
    now = time.perf_counter()
    if seq > r.seq:
      r.seq = seq
      r.ready = {"base": base, "samples": samples, "microbatch": microbatch, "at": now}
      if samples:
        r.estimate_s = now - r.started_s

  def _decide(self) -> bool:
    """Publishes a round (or the end) if the rule says so; True when the run is over (or
    stops)."""
    self._deadline = None
    ready = [i for i, r in enumerate(self.replicas) if r.ready is not None]
    if not ready:
      return False
    if not self._stop and self.store.try_get("stop") is not None:
      self._stop = self.store.increment("claim", 0) < self.total   # at the end: just finish
    flying = [i for i, r in enumerate(self.replicas) if r.ready is None]
    contributors = [i for i in ready if self.replicas[i].ready["samples"] > 0]
    if not flying:
      if not contributors and self.store.increment("claim", 0) >= self.total:
        self._publish(Message(version=self.version, samples=self.applied, done=True))
        return True
      if contributors:
        return self._close(ready)
      return False
    if (self.settings.mode == "sync" or self.store.increment("claim", 0) >= self.total or
        self.cut_due):
      return False                       # wait for everyone (at the end of the stream, a cut)
    fresh = [i for i in contributors if self.replicas[i].ready["base"] == self.version]
    if not fresh:
      return False
    bound = self.settings.staleness_bound
    if any(self.version + 1 - self.replicas[i].state_version > bound for i in flying):
      return False                       # a replica would fall too far behind: wait for it
    first = min(self.replicas[i].ready["at"] for i in fresh)
    grace = self.settings.grace if self.settings.mode == "ssaw" else 0.0
    deadline = first + grace * (first - self._open_s)
    expected = [i for i in flying if self.replicas[i].estimate_s is None or
                self.replicas[i].started_s + self.replicas[i].estimate_s <= deadline]
    if time.perf_counter() >= deadline or not expected:
      self._close(ready)
    else:
      self._deadline = deadline
    return False

  @property
  def cut_due(self) -> bool:
    """Whether the next round is a cut (the samples applied reached the next multiple of
    checkpoint_every_samples, or a process asked to stop)."""
    return (bool(self.cut_every) and self.applied >= self._next_cut) or self._stop

  def resume_point(self) -> Resume:
    """What a coordinator resuming after the last round needs (read right after a cut)."""
    last = next((m.elapsed_s for m in reversed(self.rounds) if not m.done), self._before_s)
    return Resume(self.version, self.applied, last, self._next_eval, self._next_cut)

  def _close(self, members: list[int]) -> bool:
    """Publishes the round of `members`; True if it is the cut the run stops at."""
    reps = [self.replicas[i] for i in members]
    samples = [r.ready["samples"] for r in reps]
    staleness = [self.version - r.ready["base"] if r.ready["samples"] else 0 for r in reps]
    has = [i for i, n in enumerate(samples) if n > 0]
    comb = weights_lib.combine([samples[i] for i in has], [staleness[i] for i in has],
                               self.batch_size, self.settings)
    w = np.zeros(len(members))
    w[has] = comb.weights
    at_count = self.learning_rate(float(self.version))
    factor = 1.0 if at_count == 0.0 else (
        self.learning_rate(self.applied / self.batch_size) * comb.lr_scale / at_count)
    source = min(i for i in members if self.replicas[i].state_version == self.version)
    cut = self.cut_due and len(members) == self.num_replicas
    while cut and self.cut_every and self._next_cut <= self.applied + comb.samples:
      self._next_cut += self.cut_every
    self.applied += comb.samples
    snapshot = self.applied >= self._next_eval or (
        self.store.increment("claim", 0) >= self.total and
        all(self.replicas[i].ready is not None for i in range(self.num_replicas)))
    while self._next_eval <= self.applied:
      self._next_eval += self.eval_every
    now = time.perf_counter()
    msg = Message(self.version + 1, tuple(members), tuple(float(x) for x in w), float(factor),
                  source, any(r.state_version < self.version for r in reps), self.applied,
                  now - self._t0, snapshot, tuple(staleness),
                  tuple(r.ready["microbatch"] for r in reps), checkpoint=cut,
                  stop=cut and self._stop)
    self.version += 1
    for r in reps:
      r.state_version, r.started_s, r.ready = self.version, now, None
    self._open_s = now
    self._publish(msg)
    return msg.stop

  def _publish(self, msg: Message) -> None:
    self.rounds.append(msg)
    self.store.set(f"round/{len(self.rounds)}", msg.to_json())


# --- group programs: collectives over a round's members only --------------------------------------


def local_mesh(global_mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
  """This process's row of the (data, tensor) mesh, as a (1, tensor) mesh: its replica."""
  devices = np.asarray(global_mesh.devices)
  row = [r for r in range(devices.shape[0])
         if all(d.process_index == jax.process_index() for d in devices[r])]
  if len(row) != 1:
    raise ValueError(f"mesh: process {jax.process_index()} must hold exactly one data row of "
                     f"the mesh (one replica), holds rows {row}")
  return Mesh(devices[row[0]:row[0] + 1], mesh_lib.AXES)


def _to_local(x: jax.Array, sharding: NamedSharding) -> jax.Array:
  """This process's copy of a group array (replicated over the group's `data` axis)."""
  return jax.make_array_from_single_device_arrays(
      x.shape, sharding, [s.data for s in x.addressable_shards])


def _to_group(x: jax.Array, sharding: NamedSharding, leading: int | None) -> jax.Array:
  """A group array from this process's local array: stacked over members when `leading` is
  their count (x is [1, ...]), else the same value on every member (replicated)."""
  shape = x.shape if leading is None else (leading,) + x.shape[1:]
  return jax.make_array_from_single_device_arrays(
      shape, sharding, [s.data for s in x.addressable_shards])


class GroupPrograms:
  """The update of a round, compiled per member set (see module doc).

  Args:
    local: the engine of this process's replica (its local mesh).
    global_mesh: the job's (data, tensor) mesh, one data row per process.
    state: a padded state of `local` (shapes and shardings).
  """

  def __init__(self, local: engine_lib.Engine, global_mesh: jax.sharding.Mesh,
               state: engine_lib.TrainState):
    self.local, self.global_mesh = local, global_mesh
    self.local_state_shardings = local.state_shardings(state.params)
    self._specs = jax.tree.map(lambda s: s.spec, self.local_state_shardings)
    self._programs: dict = {}
    self.compiled = 0
    self._warm = False

  def _mesh(self, members) -> jax.sharding.Mesh:
    devices = np.asarray(self.global_mesh.devices)
    return Mesh(devices[list(members)], mesh_lib.AXES)

  def _program(self, members: tuple, join: bool):
    key = (members, join)
    if key not in self._programs:
      mesh = self._mesh(members)
      plain = jax.tree.map(lambda spec: NamedSharding(mesh, spec), self._specs)
      stacked = jax.tree.map(lambda spec: P(mesh_lib.DATA, *spec), self._specs)
      tx = self.local.tx

      def combine(pending, weights, source, state=None):
        """Per device: this member's weighted gradient and (join) the source's state, summed
        over the members with one all-reduce per dtype."""
        i = jax.lax.axis_index(mesh_lib.DATA)
        w = weights[i]
        grads = jax.tree.map(lambda p: jnp.where(w > 0, w * p[0], 0.0), pending)
        if state is None:
          return psum_packed(grads, mesh_lib.DATA)
        state = jax.tree.map(lambda x: jnp.where(source[i], x[0], jnp.zeros_like(x[0])), state)
        return psum_packed((grads, state), mesh_lib.DATA)

      def update(state, pending, weights, lr_factor, source):
        # check_vma=False: packing puts tensor-replicated leaves in one vector with split ones,
        # so JAX cannot see that the former stay equal on every tensor device; they do (equal
        # inputs, the same arithmetic, one sum over `data`).
        if join:     # the source member's state, to everyone
          grads, state = jax.shard_map(
              combine, mesh=mesh, in_specs=(stacked.params, P(), P(), stacked),
              out_specs=(self._specs.params, self._specs), check_vma=False)(
                  pending, weights, source, state)
        else:
          grads = jax.shard_map(
              combine, mesh=mesh, in_specs=(stacked.params, P(), P()),
              out_specs=self._specs.params, check_vma=False)(pending, weights, source)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        updates = jax.tree.map(lambda u: u * lr_factor, updates)
        return engine_lib.TrainState(optax.apply_updates(state.params, updates), opt_state)

      self._programs[key] = (jax.jit(update, out_shardings=plain), mesh)
      self.compiled += 1
    return self._programs[key]

  def run(self, members: tuple, join: bool, state, pending, weights, lr_factor: float,
          source: int):
    """One round's update on this member: returns its new local state. `state` and `pending`
    ([1, *P]) are this process's; every member calls with the same message."""
    fn, mesh = self._program(members, join)
    k = len(members)
    stacked = lambda spec: NamedSharding(mesh, P(mesh_lib.DATA, *spec))
    plain = lambda spec: NamedSharding(mesh, spec)
    if join:
      state_in = jax.tree.map(lambda x, spec: _to_group(stack1(x), stacked(spec), k), state,
                              self._specs)
    else:
      state_in = jax.tree.map(lambda x, spec: _to_group(x, plain(spec), None), state,
                              self._specs)
    pending_in = jax.tree.map(lambda x, spec: _to_group(x, stacked(spec), k), pending,
                              self._specs.params)
    src = np.asarray([m == source for m in members])
    out = fn(state_in, pending_in, np.asarray(weights, np.float32), np.float32(lr_factor), src)
    return jax.tree.map(_to_local, out, self.local_state_shardings)

  def warm_up(self, state, pending, num_replicas: int) -> None:
    """Compiles and runs (on throwaway copies) the programs of every member set that holds this
    process (only the full set and singletons beyond _WARM_ALL_SUBSETS replicas), in one global
    order, so every set's members run it together."""
    if self._warm:
      return
    self._warm = True
    me = jax.process_index()
    sets = [s for n in range(num_replicas, 0, -1)
            for s in itertools.combinations(range(num_replicas), n)]
    if num_replicas > _WARM_ALL_SUBSETS:
      sets = [s for s in sets if len(s) in (1, num_replicas)]
    for members in sets:
      if me not in members:
        continue
      for join in ((False, True) if len(members) > 1 else (False,)):
        copy = jax.tree.map(lambda x: x.copy(), state)
        w = np.full(len(members), 1.0 / len(members))
        jax.block_until_ready(self.run(members, join, copy, pending, w, 0.0, members[0]))


def psum_packed(tree, axis: str):
  """`lax.psum(tree, axis)` as one all-reduce per dtype: the leaves are packed into one vector
  first (a collective per leaf costs a round trip each, and under CPU contention every round
  trip waits for a descheduled process). For use inside `shard_map`."""
  leaves, treedef = jax.tree.flatten(tree)
  out = list(leaves)
  for dtype in sorted({x.dtype for x in leaves}, key=str):
    index = [i for i, x in enumerate(leaves) if x.dtype == dtype]
    flat = jax.lax.psum(jnp.concatenate([leaves[i].reshape(-1) for i in index]), axis)
    offset = 0
    for i in index:
      out[i] = flat[offset:offset + leaves[i].size].reshape(leaves[i].shape)
      offset += leaves[i].size
  return jax.tree.unflatten(treedef, out)


def stack1(x: jax.Array) -> jax.Array:
  """x [*P] -> [1, *P] (one replica's stacked form), each device keeping its own shard."""
  sharding = x.sharding
  stacked = NamedSharding(sharding.mesh, P(mesh_lib.DATA, *sharding.spec))
  return jax.make_array_from_single_device_arrays(
      (1,) + x.shape, stacked, [s.data[None] for s in x.addressable_shards])


# --- one process's replica ------------------------------------------------------------------------


class RoundsReplica:
  """This process's replica in an ssaw / async run (see module doc).

  Args:
    store: the run's key-value store.
    programs: `programs.Programs` of the local engine (computes this replica's gradients).
    groups: the round updates (`GroupPrograms`).
    plan: the local tensor plan.
    total_microbatches: the stream's length; microbatch_samples: samples per microbatch.
    version: the version its state is at (a resumed run's cut; else 0).
    computed: the microbatches it computed before a resume.
  """

  def __init__(self, store: KeyValue, programs, groups: GroupPrograms, plan, *,
               total_microbatches: int, microbatch_samples: int, version: int = 0,
               computed: tuple = ()):
    self.store, self.programs, self.groups, self.plan = store, programs, groups, plan
    self.total, self.samples = total_microbatches, microbatch_samples
    self.computed: list[int] = list(computed)   # the microbatches this replica computed
    self.done = False                  # the coordinator said so
    self.end: Message | None = None    # its "done" message
    self._pending = None
    self._seq, self._k, self._version = 0, 1, version

  def next_round(self, state, microbatch: Callable[[int], dict]):
    """Claims, computes and posts one microbatch (or, past the stream's end, nothing), then
    applies the next round this replica is in. Returns (state, the round's `Message` or None
    once the coordinator says done, the loss terms of the gradient this replica contributed
    or None)."""
    me, engine = jax.process_index(), self.programs.engine
    if self._pending is None:
      self._pending = self.programs.zeros(state.params)
    j = self.store.increment("claim") - 1
    terms, samples = None, 0
    if j >= self.total:
      j = -1
    else:
      batch = engine.shard_batch(microbatch(j))
      self._pending, terms = self.programs.compute(state, self._pending, batch,
                                                   self.plan, np.ones(1, bool))
      terms = jax.device_get(terms)      # waits for the gradient
      samples = self.samples
      self.computed.append(j)
    n = self.store.increment("posts") - 1
    self.store.set(f"post/{n}", f"{me} {self._seq} {self._version} {samples} {j}")
    self._seq += 1
    while True:
      msg = Message.from_json(self.store.get(f"round/{self._k}"))
      self._k += 1
      if msg.done:
        self.done, self.end = True, msg
        return state, None, None
      if me in msg.members:
        break
    state = self.groups.run(msg.members, msg.join, state, self._pending, msg.weights,
                            msg.lr_factor, msg.source)
    self._version = msg.version
    return state, msg, terms


class Averager:
  """Local SGD's outer step over every process: one (packed) all-reduce of the replicas'
  parameters, then the outer update on every process.

  Args:
    local: the engine of this process's replica; global_mesh: the job's mesh.
    settings: the outer optimizer.
  """

  def __init__(self, local: engine_lib.Engine, global_mesh: jax.sharding.Mesh,
               settings: settings_lib.SyncSettings):
    self.local, self.mesh, self.settings = local, global_mesh, settings
    self._specs = jax.tree.map(lambda s: s.spec, local.param_shardings)
    plain = jax.tree.map(lambda spec: NamedSharding(global_mesh, spec), self._specs)
    stacked = jax.tree.map(lambda spec: P(mesh_lib.DATA, *spec), self._specs)
    r = global_mesh.shape[mesh_lib.DATA]

    def outer(params, replicas, momentum):
      mean = jax.shard_map(   # check_vma=False: see GroupPrograms (packing)
          lambda x: jax.tree.map(lambda s: s / r, psum_packed(
              jax.tree.map(lambda y: y[0], x), mesh_lib.DATA)),
          mesh=global_mesh, in_specs=(stacked,), out_specs=self._specs,
          check_vma=False)(replicas)
      return programs_lib.outer_update(settings, params, mean, momentum)

    self._fn = jax.jit(outer, out_shardings=(plain, plain))

  def __call__(self, params, stacked, momentum):
    """(new global params, new momentum), this process's copies; `stacked` is its [1, *P]
    replica parameters, `params` and `momentum` its copies of the global ones."""
    r = self.mesh.shape[mesh_lib.DATA]
    plain = lambda x, spec: _to_group(x, NamedSharding(self.mesh, spec), None)
    stack = lambda x, spec: _to_group(x, NamedSharding(self.mesh, P(mesh_lib.DATA, *spec)), r)
    out = self._fn(jax.tree.map(plain, params, self._specs),
                   jax.tree.map(stack, stacked, self._specs),
                   jax.tree.map(plain, momentum, self._specs))
    params, momentum = out
    return (jax.tree.map(_to_local, params, self.local.param_shardings),
            jax.tree.map(_to_local, momentum, self.local.param_shardings))
