"""Predicted time of data-parallel training under each sync mode, from replica times and links.

A pure function for planners (the partition/placement planner, the simulator): given how long
each data-parallel replica takes for its share of one global batch (`replica_s`, e.g. a
pipeline's or a tensor group's predicted step time) and what the links cost, `predict` says how
many seconds each mode needs per global batch of samples (`batch_s`, the figure to compare:
every mode trains the same samples) and per optimizer update.

  sync       every step waits for the slowest replica, then all-reduces: max(replica_s) + comm_s.
  ssaw/async the round rule (`timeline.Timeline`) played on replica_s, each round followed by
             its all-reduce (comm_s) and, when a late replica joins, a broadcast of the current
             parameters and optimizer state to it (join_s): fast replicas do not wait for slow
             ones (up to the staleness bound), so the time per batch falls towards the
             replicas' combined throughput.
  local_sgd  local_steps local steps at the slowest replica's pace, then one all-reduce of the
             parameter deltas: max(replica_s) + comm_s / local_steps.

What it leaves out: accuracy. ssaw's stale gradients and local_sgd's drift can cost samples to
reach a loss (the study in experiments/bench_ssaw.py measures it); a planner should weigh
`batch_s` with that, e.g. by the measured time to a target loss.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from semijax.sync import settings as settings_lib
from semijax.sync import timeline as timeline_lib

# Microbatches per replica the round rule is played for; the first quarter is skipped (warm-up).
_ROUNDS_PER_REPLICA = 64


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted timing of one mode.

  Attributes:
    mode: the sync mode.
    batch_s: seconds per global batch of samples (what to compare between modes).
    update_s: seconds per optimizer update (ssaw/async make more, smaller updates).
    mean_staleness: mean staleness of the applied gradients, in updates (0 for sync).
    idle_share: share of the replicas' time spent waiting for others.
  """

  mode: str
  batch_s: float
  update_s: float
  mean_staleness: float = 0.0
  idle_share: float = 0.0


def ring_allreduce_s(nbytes: float, num_replicas: int, bandwidth_bps: float,
                     latency_s: float = 0.0) -> float:
  """Seconds of a ring all-reduce of `nbytes` among `num_replicas` over links of
  `bandwidth_bps` bytes/s and `latency_s` each: 2 (R-1)/R nbytes / bandwidth + 2 (R-1) latency."""
  r = num_replicas
  if r <= 1:
    return 0.0
  return 2.0 * (r - 1) / r * nbytes / bandwidth_bps + 2.0 * (r - 1) * latency_s


def predict(mode: str, replica_s: Sequence[float], *, comm_s: float = 0.0,
            join_s: float | None = None,
            settings: settings_lib.SyncSettings | None = None) -> Prediction:
  """The predicted timing of `mode` (see module doc).

  Args:
    mode: "sync", "ssaw", "async" or "local_sgd".
    replica_s: seconds each replica computes its share of one global batch (batch_size / R
      samples), without communication.
    comm_s: seconds of one all-reduce of the gradients (or deltas) among the replicas
      (`ring_allreduce_s` from bytes and a link).
    join_s: seconds to send a late replica the current parameters and optimizer moments;
      default 1.5 x comm_s (three parameter-sized trees one way, against an all-reduce's two
      passes).
    settings: staleness bound, grace, local_steps (defaults: `SyncSettings()`).

  Raises:
    ValueError: an unknown mode or a replica time that is not positive.
  """
  t = np.asarray(replica_s, np.float64)
  if mode not in settings_lib.MODES:
    raise ValueError(f"mode: {mode!r} is not one of {settings_lib.MODES}")
  if t.ndim != 1 or not len(t) or not np.all(t > 0) or not np.all(np.isfinite(t)):
    raise ValueError(f"replica_s: need positive seconds per replica, got {list(replica_s)}")
  settings = dataclasses.replace(settings or settings_lib.SyncSettings(), mode=mode)
  join_s = 1.5 * comm_s if join_s is None else join_s
  slowest = float(t.max())
  if mode == "sync" or len(t) == 1:
    step = slowest + comm_s
    return Prediction(mode, step, step, 0.0, float(1.0 - t.mean() / slowest))
  if mode == "local_sgd":
    h = settings.local_steps
    batch = slowest + comm_s / h
    return Prediction(mode, batch, h * batch, 0.0, float(1.0 - t.mean() / slowest))
  return _play_rounds(settings, t, comm_s, join_s)


def predict_all(replica_s: Sequence[float], **kwargs) -> dict[str, Prediction]:
  """{mode: `predict(mode, replica_s, **kwargs)`} for every mode."""
  return {m: predict(m, replica_s, **kwargs) for m in settings_lib.MODES}


def _play_rounds(settings, t: np.ndarray, comm_s: float, join_s: float) -> Prediction:
  """ssaw/async: the round rule played for _ROUNDS_PER_REPLICA microbatches per replica; the
  figures are of the rounds after the first quarter and before the last (which drains)."""
  r = len(t)
  line = timeline_lib.Timeline(settings, r, 1, _ROUNDS_PER_REPLICA * r)
  line.start(t)
  rounds = []
  while (rnd := line.take()) is not None:
    rounds.append(rnd)
    line.start(t, comm_s + (join_s if any(rnd.staleness) else 0.0))
  skip = max(1, len(rounds) // 4)
  steady = rounds[skip:-1] or rounds[-1:]
  elapsed = steady[-1].close_s - rounds[skip - 1].close_s
  microbatches = sum(len(x.members) for x in steady)       # one microbatch = 1/R of a batch
  busy = sum(float(t[m]) for x in steady for m in x.members)
  staleness = [s for x in steady for s in x.staleness]
  return Prediction(settings.mode, elapsed * r / microbatches, elapsed / len(steady),
                    float(np.mean(staleness)), max(0.0, 1.0 - busy / (r * elapsed)))
