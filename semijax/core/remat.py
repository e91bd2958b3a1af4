"""Rematerialization of the transformer blocks (`config.model.remat_policy`, MaxText's name).

A training step keeps every block's activations for the backward pass; at long sequences or big
microbatches they outgrow the device. A policy trades compute for that memory, block by block
(`jax.checkpoint` around each block's forward pass):

- "none": keep what autodiff keeps (the fastest step, the most memory).
- "full": keep only each block's input [batch, seq, d_model]; the backward pass reruns the
  block's forward pass (up to a third more compute for the step).
- "minimal": keep the outputs of the GEMMs whose operands have no batch dimension (the
  projections); the backward pass recomputes the attention scores, softmax, norms and
  elementwise work, not the projections.

It changes neither the values (a rematerialized step computes the same numbers) nor what a
checkpoint holds, so a run may resume under another policy. A pipelined step keeps only each
stage's input per microbatch and reruns the stage's forward pass in its backward tick
(`core.pipeline`); the policy says what that rerun keeps of each block. The pallas width kernel
rematerializes on GPUs and TPUs; off them it runs in Pallas's interpreter, whose callbacks
`jax.checkpoint` cannot replay (`check`).
"""

from __future__ import annotations

import jax
from flax import nnx

POLICIES = ("none", "full", "minimal")

_SAVEABLE = {"full": None,    # jax.checkpoint's default: nothing inside is saved
             "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def run_block(block: nnx.Module, x: jax.Array, plan, policy: str) -> jax.Array:
  """`block(x, plan)`, x [batch, seq, d_model] (local rows, inside `shard_map`), its activations
  kept for the backward pass as `policy` says (`POLICIES`)."""
  if policy == "none":
    return block(x, plan)
  graphdef, state = nnx.split(block)

  def forward(state, x, plan):
    return nnx.merge(graphdef, state)(x, plan)
  return jax.checkpoint(forward, policy=_SAVEABLE[policy])(state, x, plan)


def check(policy: str, kernel: str, backend: str | None = None) -> None:
  """Raises ValueError naming `model.remat_policy` where it cannot run: an unknown policy, or a
  rematerialized pallas width kernel (`layout.kernel`) off GPUs and TPUs (see module doc);
  `backend` defaults to jax.default_backend()."""
  if policy not in POLICIES:
    raise ValueError(f"model.remat_policy: {policy!r} is not one of {POLICIES}")
  backend = backend or jax.default_backend()
  # ("auto" picks pallas on GPUs and TPUs only, so only an explicit "pallas" gets here.)
  if policy != "none" and kernel == "pallas" and backend not in ("gpu", "tpu"):
    raise ValueError(f"model.remat_policy: {policy!r} with layout.kernel 'pallas' needs a GPU or "
                     f"TPU (on {backend!r} the kernel runs in Pallas's interpreter, which cannot "
                     "be rematerialized); use layout.kernel 'switch' or remat_policy 'none'")
