"""Dynamic loss scaling (`config.optimizer.loss_scale`), for training in float16.

float16 holds magnitudes down to about 6e-8: the gradients of a deep model's activations fall
below that and flush to zero. A step therefore differentiates the loss times a scale S (a power
of two, so scaling is exact), which lifts every cotangent of the backward pass by S, and divides
the gradients by S before anything else reads them (`StepFunctions.train_step`). `dynamic` wraps
the optimizer: where any gradient is not finite (S overflowed the backward pass), the step
applies nothing (the parameters, moments and step count stay as they were) and halves S; after
`period` finite steps in a row it doubles S. The scale and that count live in the optimizer
state, so checkpoints, migrations and resumes carry them like Adam's step count.

bfloat16 has float32's range and needs none of this.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

FACTOR = 2.0           # what an overflow divides the scale by, and `period` finite steps multiply
MINIMUM = 1.0          # the scale never drops below this


class LossScaleState(NamedTuple):
  """scale: float32 [], the current S; good_steps: int32 [], finite steps since S last changed;
  inner: the wrapped optimizer's state."""

  scale: jax.Array
  good_steps: jax.Array
  inner: Any


def dynamic(inner: optax.GradientTransformation, initial: float = 2.0 ** 15,
            period: int = 2000) -> optax.GradientTransformation:
  """`inner`, skipping steps whose gradients are not finite and adjusting the loss scale (see
  module doc). Its `update` takes gradients already divided by the scale."""

  def init(params):
    return LossScaleState(jnp.asarray(initial, jnp.float32), jnp.zeros((), jnp.int32),
                          inner.init(params))

  def update(grads, state: LossScaleState, params=None):
    finite = all_finite(grads)
    updates, inner_state = inner.update(grads, state.inner, params)
    updates = optax.tree.where(finite, updates, optax.tree.zeros_like(updates))
    inner_state = optax.tree.where(finite, inner_state, state.inner)
    grow = state.good_steps + 1 >= period
    scale = jnp.where(finite, jnp.where(grow, state.scale * FACTOR, state.scale),
                      jnp.maximum(state.scale / FACTOR, MINIMUM))
    good = jnp.where(finite & ~grow, state.good_steps + 1, 0).astype(jnp.int32)
    return updates, LossScaleState(scale.astype(jnp.float32), good, inner_state)

  return optax.GradientTransformation(init, update)


def all_finite(tree) -> jax.Array:
  """bool []: whether every value of every array of `tree` is finite."""
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def unscaled(grads, scale: jax.Array):
  """grads (of the loss times `scale`) divided by it, each in its own dtype: exact for a power
  of two. `scale` is float32 [], or [R] for stacked gradients [R, ...] (one per replica)."""
  def one(g):
    return (g / jnp.reshape(scale, scale.shape + (1,) * (g.ndim - scale.ndim))).astype(g.dtype)
  return jax.tree.map(one, grads)


def scale_of(opt_state) -> jax.Array | None:
  """The current loss scale (float32 []) of an optimizer state `dynamic` made, else None."""
  return opt_state.scale if isinstance(opt_state, LossScaleState) else None
