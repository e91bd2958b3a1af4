"""`SyncSettings`: the typed form of `config.sync` (and `config.hetero.replica_slowdown`).

How data-parallel replicas combine their work, validated once; `validate` raises a ConfigError
that names the field, what is wrong and what is allowed. docs/config.md lists every
field with its default.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

from semijax.errors import ConfigError

MODES = ("sync", "ssaw", "async", "local_sgd")
WEIGHTINGS = ("poly", "exp", "samples")
OUTERS = ("average", "nesterov")


@dataclasses.dataclass(frozen=True)
class SyncSettings:
  """How data-parallel replicas combine gradients (`config.sync`).

  Attributes:
    mode: "sync" (one all-reduce per step, every replica waits for the slowest: the default),
      "ssaw" (semi-synchronous rounds with adaptive weights), "async" (bounded-staleness
      asynchronous: every arrival applied unweighted at the full learning rate) or "local_sgd"
      (local steps, parameter deltas averaged every `local_steps`).
    staleness_bound: ssaw, async: a gradient is applied at most this many updates after the
      version it was computed on; the others wait for a replica that would exceed it.
    grace: ssaw: a round also waits for the replicas expected within (1 + grace) times the
      compute time of its first fresh arrival (absorbs noise between near-equal replicas).
    weighting: ssaw: the staleness discount of a contribution's weight (weight = its samples x
      discount): "poly" (1 + staleness)^-staleness_power, "exp" staleness_decay^staleness, or
      "samples" (no discount).
    staleness_power: "poly"'s exponent. staleness_decay: "exp"'s factor per update.
    lr_batch_power: ssaw: an update's learning rate is the schedule's (at the samples applied so
      far) times (sum of its weights / batch_size)^lr_batch_power (0: every round a full step;
      0.5: Adam's square-root scaling rule; 1: linear).
    local_steps: local_sgd: local optimizer steps between two averages (H).
    outer: local_sgd: "average" (the replicas' parameters are averaged) or "nesterov" (DiLoCo:
      the averaged delta is an outer gradient for SGD with Nesterov momentum).
    outer_lr, outer_momentum: the outer Nesterov optimizer's learning rate and momentum
      (DiLoCo's 0.7 and 0.9).
    replica_slowdown: `config.hetero.replica_slowdown`: one emulated slowdown factor per data
      replica (multiplies its tensor group's emulated compute time), or None for none.
  """

  mode: str = "sync"
  staleness_bound: int = 4
  grace: float = 0.25
  weighting: str = "poly"
  staleness_power: float = 1.0
  staleness_decay: float = 0.5
  lr_batch_power: float = 0.0
  local_steps: int = 8
  outer: str = "average"
  outer_lr: float = 0.7
  outer_momentum: float = 0.9
  replica_slowdown: tuple[float, ...] | None = None

  @property
  def rounds(self) -> bool:
    """Whether the replicas combine in rounds (ssaw, async) rather than in lockstep."""
    return self.mode in ("ssaw", "async")

  def validate(self, num_replicas: int | None) -> "SyncSettings":
    """Raises ConfigError naming the first bad field; `num_replicas` = mesh.data, or None while
    it is not known yet (a run that the planner will shape: the checks against it wait)."""
    f = "config.sync"
    if self.mode not in MODES:
      raise ConfigError(f"{f}.mode: {self.mode!r} is not one of {list(MODES)}")
    if self.weighting not in WEIGHTINGS:
      raise ConfigError(f"{f}.weighting: {self.weighting!r} is not one of {list(WEIGHTINGS)}")
    if self.outer not in OUTERS:
      raise ConfigError(f"{f}.outer: {self.outer!r} is not one of {list(OUTERS)}")
    for name, lo in (("staleness_bound", 0), ("local_steps", 1)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ConfigError(f"{f}.{name}: must be an integer >= {lo}, got {v!r}")
    for name in ("grace", "staleness_power"):
      v = getattr(self, name)
      if not _is_number(v) or v < 0:
        raise ConfigError(f"{f}.{name}: must be a number >= 0, got {v!r}")
    for name, ok, interval in (
        ("staleness_decay", lambda v: 0 < v <= 1, "(0, 1]"),
        ("lr_batch_power", lambda v: 0 <= v <= 1, "[0, 1]"),
        ("outer_momentum", lambda v: 0 <= v < 1, "[0, 1)")):
      v = getattr(self, name)
      if not _is_number(v) or not ok(v):
        raise ConfigError(f"{f}.{name}: must be in {interval}, got {v!r}")
    if not _is_number(self.outer_lr) or self.outer_lr <= 0:
      raise ConfigError(f"{f}.outer_lr: must be a positive number, got {self.outer_lr!r}")
    if num_replicas is None:
      return self
    if self.mode != "sync" and num_replicas < 2:
      raise ConfigError(f"{f}.mode: {self.mode!r} combines data-parallel replicas, but "
                        f"mesh.data = {num_replicas}; set mesh.data >= 2 or mode 'sync'")
    r = self.replica_slowdown
    if r is not None:
      field = "config.hetero.replica_slowdown"
      bad = [s for s in r if not _is_number(s) or s <= 0]
      if bad:
        raise ConfigError(f"{field}: every factor must be a positive finite number, got "
                          f"{bad[0]!r} in {r}")
      if len(r) != num_replicas:
        raise ConfigError(f"{field}: {len(r)} factors {r} for mesh.data = {num_replicas} "
                          "replicas; give one per replica or ()")
    return self


def _is_number(v) -> bool:
  return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)
