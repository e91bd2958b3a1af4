"""ssaw and async on emulated replicas in one process: the round rule driving the programs.

All R replicas live on one (data, tensor) mesh; a replica's speed is emulated (its microbatch
takes `durations[r]` seconds of the emulated clock). What is computed is exactly what replicas
of those speeds compute: a replica's gradient is computed on the parameters of the version it
starts on, when it starts (`Programs.compute` on the current parameters), kept in its slot of the
stacked `pending` tree while it is in flight, and applied in the round it arrives in
(`Programs.apply`, weighted by `weights.combine`). Only the *time* is emulated: the caller sleeps
each round's emulated seconds (`Result.emulated_s`).

A round that is exactly a synchronous step (every replica fresh on one global batch, and every
earlier round a full batch, so the learning-rate schedule is at the same point) runs the
engine's own train step instead: its gradients are left uncomputed at the start (`deferred`) and
the step computes and applies them. With equal speeds every round is such a step, so ssaw and
async train bit for bit like sync.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import jax
import numpy as np

from semijax.core import engine as engine_lib
from semijax.core import plan as plan_lib
from semijax.sync import programs as programs_lib
from semijax.sync import settings as settings_lib
from semijax.sync import timeline as timeline_lib
from semijax.sync import weights as weights_lib


@dataclasses.dataclass(frozen=True)
class Result:
  """One update of a rounds run.

  Attributes:
    round: the round (members, staleness, samples, emulated open/close times).
    emulated_s: emulated seconds between the previous update and this one.
    step: whether it ran as a synchronous step.
    lr_scale: the factor on the scheduled learning rate (1 for a step).
    metrics: device scalars {"grad_norm", and for a step "loss", "accuracy"}.
    terms: per-replica loss terms {name: [R]} of the gradients computed after the update (None
      when none were), with `started` [R] bool saying whose they are.
  """

  round: timeline_lib.Round
  emulated_s: float
  step: bool
  lr_scale: float
  metrics: dict
  terms: dict | None
  started: np.ndarray


class RoundRunner:
  """Runs ssaw or async on the emulated replicas of one engine (see module doc).

  Args:
    engine: the run's engine; its `data` axis holds the replicas.
    settings: mode (ssaw or async) and the round rule's parameters.
    batch_size: the global batch (R microbatches).
    total_microbatches: the stream's length (steps x R).
    learning_rate: progress (samples applied / batch_size, a float) -> the schedule's rate.
    programs: the engine's `programs.Programs` to use (runs of one engine can share them and
      their compiled programs), or None for new ones.
  """

  def __init__(self, engine: engine_lib.Engine, settings: settings_lib.SyncSettings, *,
               batch_size: int, total_microbatches: int,
               learning_rate: Callable[[float], float],
               programs: programs_lib.Programs | None = None):
    self.engine, self.settings = engine, settings
    self.num_replicas = engine.data_size
    self.batch_size = batch_size
    self.microbatch_samples = batch_size // self.num_replicas
    self.programs = programs or programs_lib.Programs(engine, settings)
    self.timeline = timeline_lib.Timeline(settings, self.num_replicas, self.microbatch_samples,
                                          total_microbatches)
    self.learning_rate = learning_rate
    self.applied = 0          # samples applied so far
    self.deferred = False     # the replicas in flight run as a synchronous step at arrival
    self.pending = None       # stacked [R, *P] in-flight gradients

  @property
  def done(self) -> bool:
    return self.timeline.done

  def bind(self, state: engine_lib.TrainState) -> None:
    """Compiles nothing yet; takes the state's shardings and allocates the pending slots."""
    self.programs.bind(state)
    if self.pending is None:
      self.pending = self.programs.zeros(state.params)

  def start(self, state, plan: plan_lib.Plan, microbatch: Callable[[int], dict],
            durations: Sequence[float]) -> tuple[dict | None, np.ndarray]:
    """Free replicas claim their next microbatches now (taking `durations[r]` seconds) and
    compute their gradients on `state` (unless the next round is a synchronous step).
    Returns (per-replica terms or None, started [R] bool)."""
    claims = self.timeline.start(durations)
    started = np.zeros(self.num_replicas, bool)
    nxt = self.timeline.peek()
    self.deferred = (nxt is not None and nxt.is_step(self.num_replicas, self.microbatch_samples)
                     and self.applied == self.timeline.version * self.batch_size)
    if not claims or self.deferred:
      return None, started
    template = microbatch(claims[0][1])
    rows = [jax.tree.map(np.zeros_like, template)] * self.num_replicas
    for r, j in claims:
      rows[r] = microbatch(j)
      started[r] = True
    batch = self.engine.shard_batch(jax.tree.map(lambda *x: np.concatenate(x), *rows))
    self.pending, terms = self.programs.compute(state, self.pending, batch, plan, started)
    return terms, started

  def round(self, state, plan: plan_lib.Plan, microbatch: Callable[[int], dict],
            global_batch: Callable[[int], dict], durations: Sequence[float]):
    """The next update, then the starts after it. Returns (state, `Result`).

    Args:
      state: the padded train state (donated).
      plan: the tensor plan of this update and of the gradients computed after it.
      microbatch: index -> host batch of one microbatch (batch_size / R rows).
      global_batch: k -> host global batch k (for a round that is a synchronous step).
      durations: seconds of each replica's next microbatch, if it starts one now.
    """
    rnd = self.timeline.take()
    if rnd is None:
      raise RuntimeError("RoundRunner.round: nothing in flight (the stream is done)")
    if self.deferred:
      batch = self.engine.shard_batch(global_batch(rnd.microbatches[0] // self.num_replicas))
      state, metrics = self.engine.train_step(state, batch, plan)
      scale = 1.0
    else:
      comb = weights_lib.combine(rnd.samples, rnd.staleness, self.batch_size, self.settings)
      w = np.zeros(self.num_replicas, np.float32)
      w[list(rnd.members)] = comb.weights
      scale = comb.lr_scale
      state, metrics = self.programs.apply(state, self.pending, w,
                                           np.float32(self.lr_factor(rnd.version - 1, scale)))
    step = self.deferred
    self.applied += sum(rnd.samples)
    terms, started = self.start(state, plan, microbatch, durations)
    return state, Result(rnd, rnd.close_s - rnd.open_s, step, scale, metrics, terms, started)

  def lr_factor(self, count: int, scale: float) -> float:
    """What the optimizer's rate at update `count` (its schedule over updates) is multiplied
    by to give the schedule's rate at the samples applied so far, times `scale`."""
    at_count = self.learning_rate(float(count))
    if at_count == 0.0:     # only the first update (warm-up from 0): its step is 0 anyway
      return 1.0
    return self.learning_rate(self.applied / self.batch_size) * scale / at_count

  # --- checkpoints ----------------------------------------------------------------------------

  def state_dict(self, layout) -> dict:
    """The in-flight state (clock, claims, pending gradients in logical form) as numpy."""
    return {"timeline": self.timeline.state_dict(), "applied": np.int64(self.applied),
            "deferred": np.bool_(self.deferred),
            "pending": self.programs.forms.to_host(self.pending, layout)}

  def load_state_dict(self, state: dict, layout) -> None:
    """Restores `state_dict`'s in-flight state onto `layout` (after `bind`)."""
    self.timeline.load_state_dict(state["timeline"])
    self.applied = int(state["applied"])
    self.deferred = bool(state["deferred"])
    self.pending = self.programs.forms.to_device(state["pending"], self.pending, layout,
                                                 self.programs.stacked_params)
