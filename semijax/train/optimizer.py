"""The optimizer of a run: AdamW with linear warmup and cosine decay (`config.optimizer`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from semijax.core import loss_scale
from semijax.core import pipeline
from semijax.core import precision
from semijax.errors import ConfigError


LOSS_SCALES = ("auto", "none", "dynamic")


@dataclasses.dataclass(frozen=True)
class OptimizerSpec:
  """`config.optimizer`: AdamW's settings, the warmup and the gradient clip.

  Attributes:
    learning_rate: the peak learning rate (after warmup; decays to a tenth by the last step).
    warmup_steps: linear warmup from 0.
    weight_decay: AdamW's decoupled weight decay, on matrices only.
    b1, b2: Adam's moment decay rates.
    grad_clip: global gradient-norm clip; 0 = none.
    schedule_steps: steps of the warmup-and-decay schedule; 0 = the run's steps. A run longer
      than its schedule trains on at the final rate (a study that trains past a sample budget
      to see when a loss is reached, with the schedule of the budget).
    mu_dtype: dtype of Adam's first moment; "" = the parameters' (`config.model.param_dtype`).
    loss_scale: "dynamic" (`core.loss_scale`), "none" or "auto" (dynamic where the model
      computes in float16; `resolved` decides); loss_scale_init: its first scale;
      loss_scale_period: finite steps in a row after which it doubles.
  """

  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  grad_clip: float = 1.0
  schedule_steps: int = 0
  mu_dtype: str = ""
  loss_scale: str = "auto"
  loss_scale_init: float = 2.0 ** 15
  loss_scale_period: int = 2000

  @classmethod
  def from_config(cls, o) -> "OptimizerSpec":
    """The validated spec of `config.optimizer`."""
    return cls(o.learning_rate, o.warmup_steps, o.weight_decay, o.b1, o.b2, o.grad_clip,
               o.schedule_steps, o.mu_dtype, o.loss_scale, o.loss_scale_init,
               o.loss_scale_period).validate()

  def validate(self) -> "OptimizerSpec":
    f = "config.optimizer"
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not (number(self.learning_rate) and self.learning_rate > 0):
      raise ConfigError(f"{f}.learning_rate: must be a positive number, got "
                        f"{self.learning_rate!r}")
    for name in ("warmup_steps", "schedule_steps"):
      w = getattr(self, name)
      if isinstance(w, bool) or not isinstance(w, int) or w < 0:
        raise ConfigError(f"{f}.{name}: must be an integer >= 0, got {w!r}")
    for name in ("weight_decay", "grad_clip"):
      v = getattr(self, name)
      if not (number(v) and v >= 0):
        raise ConfigError(f"{f}.{name}: must be a number >= 0, got {v!r}")
    for name in ("b1", "b2"):
      v = getattr(self, name)
      if not (number(v) and 0 <= v < 1):
        raise ConfigError(f"{f}.{name}: must be in [0, 1), got {v!r}")
    if self.mu_dtype not in precision.MU_DTYPES:
      raise ConfigError(f"{f}.mu_dtype: {self.mu_dtype!r} is not '' (the parameters' dtype) or "
                        f"one of {precision.DTYPES}")
    if self.loss_scale not in LOSS_SCALES:
      raise ConfigError(f"{f}.loss_scale: {self.loss_scale!r} is not one of {LOSS_SCALES}")
    init = self.loss_scale_init
    if not (number(init) and init >= 1 and math.log2(init).is_integer()):
      raise ConfigError(f"{f}.loss_scale_init: must be a power of two >= 1 (so that scaling is "
                        f"exact), got {init!r}")
    period = self.loss_scale_period
    if isinstance(period, bool) or not isinstance(period, int) or period < 1:
      raise ConfigError(f"{f}.loss_scale_period: must be an integer >= 1, got {period!r}")
    return self

  def resolved(self, dtype: str) -> "OptimizerSpec":
    """This spec with `loss_scale` "auto" decided: "dynamic" where the compute `dtype` is
    float16, else "none"."""
    if self.loss_scale != "auto":
      return self
    return dataclasses.replace(self, loss_scale="dynamic" if dtype == "float16" else "none")


def schedule_length(spec: OptimizerSpec, steps: int) -> int:
  """Steps of the learning-rate schedule of a run of `steps` steps."""
  return spec.schedule_steps or steps


def learning_rate_schedule(spec: OptimizerSpec, steps: int) -> optax.Schedule:
  """Linear warmup, then cosine decay to a tenth over `spec.schedule_steps` (or `steps`)."""
  steps = schedule_length(spec, steps)
  warmup = min(spec.warmup_steps, steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, spec.learning_rate, warmup, steps,
                                            spec.learning_rate * 0.1)


def _stacked(path) -> int:
  """1 for a pipelined block parameter (leading layer axis, `core.pipeline.STACK`), else 0."""
  return int(bool(path) and getattr(path[0], "key", None) == pipeline.STACK)


def make(spec: OptimizerSpec, steps: int) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay over `steps`; weight decay on matrices only
  (per layer: a pipelined stack's [layers, d] bias is not a matrix);
  optional global-norm clip; dynamic loss scaling around it all where `spec.loss_scale` says
  (resolved: not "auto")."""
  decay_mask = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, x: x.ndim - _stacked(path) >= 2, params)
  tx = optax.adamw(learning_rate_schedule(spec, steps), b1=spec.b1, b2=spec.b2,
                   weight_decay=spec.weight_decay, mask=decay_mask, mu_dtype=spec.mu_dtype or None)
  if spec.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(spec.grad_clip), tx)
  if spec.loss_scale == "dynamic":
    tx = loss_scale.dynamic(tx, spec.loss_scale_init, spec.loss_scale_period)
  return tx
