"""What a simulated run trains: the model (`core.spec.ModelSpec`), the batch, and what they cost.

Everything the step time needs of the model is counted here, from the same `ModelSpec` the
engine and the cost model use: FLOPs per unit (`ModelSpec.flops_per_unit`, forward, per token)
times `core.emulation.FWD_BWD_FACTOR` for forward plus backward; the bytes of one unit's weights
(what `core.engine.Engine.unit_bytes` counts); the activations every block all-reduces; the
repeated (unsplit) layers and their parameters; the state a device updates.

Bytes follow the spec's precision and Adam's first-moment dtype (`planner.costs.StateBytes`):
activations and the weights a block reads in the compute dtype; parameters, gradients and
Adam's moments in the storage dtype, the first moment in `mu_dtype` when set. All float32 by
default.
"""

from __future__ import annotations

import dataclasses

from semijax.core import emulation
from semijax.core import precision as precision_lib
from semijax.core import spec as spec_lib
from semijax.errors import ConfigError
from semijax.planner import costs as costs_lib

LAYERNORM_FLOPS = spec_lib.LAYERNORM_FLOPS


@dataclasses.dataclass(frozen=True)
class Workload:
  """A GPT-style model and its batch.

  Attributes:
    spec: the model (d_model, heads, d_ff, layers, sequence length, causality, precision).
    vocab_size: the embedding and head size.
    batch_per_replica: sequences one data-parallel replica trains per step.
    microbatches: pipeline microbatches per step (1 without a pipeline).
    mu_dtype: Adam's first moment ("": the parameters' dtype, `optimizer.mu_dtype`).
  """

  spec: spec_lib.ModelSpec
  vocab_size: int
  batch_per_replica: int
  microbatches: int = 1
  mu_dtype: str = ""

  def __post_init__(self):
    for name in ("vocab_size", "batch_per_replica", "microbatches"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ConfigError(f"sim.workload.{name}: must be an integer >= 1, got {v!r}")
    if self.mu_dtype not in precision_lib.MU_DTYPES:
      raise ConfigError(f"sim.workload.mu_dtype: {self.mu_dtype!r} is not '' (the parameters' "
                        f"dtype) or one of {precision_lib.DTYPES}")
    if self.batch_per_replica % self.microbatches:
      raise ConfigError(f"sim.workload.microbatches: {self.microbatches} does not divide "
                        f"batch_per_replica = {self.batch_per_replica}")

  @classmethod
  def gpt(cls, *, d_model: int, num_heads: int, d_ff: int, num_layers: int, seq_len: int,
          vocab_size: int, batch_per_replica: int, microbatches: int = 1,
          precision: precision_lib.Precision = precision_lib.Precision(),
          **kw) -> "Workload":
    """A causal GPT (`models.gpt.GPT`'s spec) in `precision` with this batch (`kw`: the
    other fields, `mu_dtype`)."""
    fields = dict(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, num_heads=num_heads,
                  d_ff=d_ff, num_layers=num_layers)
    spec = spec_lib.ModelSpec("gpt", tuple(fields.items()), d_model, num_heads, d_ff, num_layers,
                              seq_len=seq_len, causal=True, items_per_example=seq_len,
                              unit="tokens", precision=precision.validate())
    return cls(spec, vocab_size, batch_per_replica, microbatches, **kw)

  @property
  def nbytes(self) -> costs_lib.StateBytes:
    """Bytes per activation, parameter, gradient and moment."""
    return costs_lib.StateBytes.of(self.spec.precision, self.mu_dtype)

  # --- sizes --------------------------------------------------------------------------------

  @property
  def tokens_per_replica(self) -> int:
    return self.batch_per_replica * self.spec.seq_len

  @property
  def tokens_per_microbatch(self) -> int:
    return self.tokens_per_replica // self.microbatches

  def unit_params(self) -> dict:
    """{kind: parameters of one unit in one layer} (`ModelSpec.unit_params`): an MLP unit's
    column of w1, bias and row of w2; a head's head_dim columns of Q, K, V with their biases and
    head_dim rows of wo (a Llama's: a KV group's, no biases)."""
    return self.spec.unit_params()

  def unit_bytes(self) -> dict:
    """{kind: bytes of one unit's weights over all layers in the compute dtype: what a block
    reads, and what offloading the unit sends} (`Engine.unit_bytes`)."""
    b = self.nbytes.compute
    return {k: float(b * p * self.spec.num_layers) for k, p in self.unit_params().items()}

  def unit_state_bytes(self) -> dict:
    """{kind: bytes of one unit's weights and Adam moments over all layers at their stored
    dtypes: what a migration moves with the unit}."""
    b = self.nbytes.state
    return {k: float(b * p * self.spec.num_layers) for k, p in self.unit_params().items()}

  def layer_repeated_params(self) -> int:
    """Unsplit parameters of one block: two LayerNorms and the two output biases."""
    return 6 * self.spec.d_model

  def edge_params(self) -> dict:
    """Unsplit parameters outside the blocks: {"first": embeddings, "last": final norm + head}."""
    d = self.spec.d_model
    return {"first": (self.vocab_size + self.spec.seq_len) * d,
            "last": 2 * d + d * self.vocab_size}

  # --- FLOPs (forward + backward, per token) ----------------------------------------------

  def unit_flops(self) -> dict:
    """{kind: forward + backward FLOPs per token of one unit in one block}."""
    return {k: emulation.FWD_BWD_FACTOR * f for k, f in self.spec.flops_per_unit().items()}

  def layer_repeated_flops(self) -> float:
    """Forward + backward FLOPs per token of one block's unsplit work (its two LayerNorms)."""
    return emulation.FWD_BWD_FACTOR * 2 * LAYERNORM_FLOPS * self.spec.d_model

  def last_flops(self) -> float:
    """Forward + backward FLOPs per token of the final norm, the head and the loss."""
    return emulation.FWD_BWD_FACTOR * self.spec.edge_flops()["last"]

  # --- bytes on the wire ----------------------------------------------------------------------

  def allreduce_bytes(self) -> float:
    """Bytes of one block's all-reduce over the tensor group, per microbatch: the block output
    [tokens, d_model] in the compute dtype (forward; the backward all-reduces as much once
    more)."""
    return float(self.tokens_per_microbatch * self.spec.d_model * self.nbytes.compute)

  def boundary_bytes(self) -> float:
    """Bytes one pipeline stage sends the next per microbatch (its activations)."""
    return self.allreduce_bytes()
