"""What the planner needs to know of a model: FLOPs and parameters per unit, layer and edge.

Built from the model's `core.spec.ModelSpec` and the nominal device rate `device_gflops` (GFLOP/s
of a device at speed 1, the rate the emulation assumes). Per unit kind k ("mlp": an MLP hidden
unit, "heads": an attention head):

  unit_ms[k] = flops_per_unit[k] * tokens / (device_gflops * 1e9) * 1e3

is the forward milliseconds of one unit of one layer for a microbatch of `tokens` tokens at
speed 1 (`ModelSpec.flops_per_unit`: the unit's GEMMs and, for heads, the products over the
sequence). Parameter counts follow `semijax.models`:

  unit_params   mlp: a column of w1, its bias, a row of w2 (2 d + 1);
                heads: head_dim columns of wq, wk, wv, their biases, head_dim rows of wo
                (4 d hd + 3 hd); a Llama's (`ModelSpec.unit_params`): an MLP unit a column of
                w_gate and of w_up and a row of w_down (3 d), a KV group (its "heads" unit) of
                g query heads g hd columns of wq and rows of wo and hd columns of wk and of wv
                (2 (g + 1) d hd), no biases;
  layer_params  what every tensor device of a stage holds per layer: two LayerNorms (scale and
                bias) and the two output biases (6 d); a Llama's two RMSNorm scales (2 d);
  first_params  the embedding (replicated over tensor, and in the pipelined engine over the
                stages too, its gradient all-reduced over them): GPT token and position
                embeddings ((vocab + seq_len) d); ViT patch projection, class token and
                positions ((p^2 C + 1) d + d + (patches + 1) d);
  last_params   the final LayerNorm and the head (replicated like the embedding): GPT
                2 d + d vocab (the head has no bias and is not tied to the embedding), ViT
                2 d + d classes + classes; Llama: embedding vocab d first, final RMSNorm and
                head d + d vocab last (d alone when the head is tied to the embedding, which
                the first stage counts).

The embedding and the head (with the final norm and the loss) are not split over `tensor`:
every device of the first stage runs the embedding whole for each microbatch, every device of
the last the head (`ModelSpec.edge_flops`: first_flops, last_flops per token), so those stages
also take `edge_s` (forward; the backward recomputes it and does twice its work, as for a
layer: `core.schedule.stage_seconds`). For a large vocabulary the head is worth several layers.

Bytes follow the model's precision (`core.precision.Precision`) and Adam's first-moment dtype
(`StateBytes`): activations (a stage boundary's transfer, the tensor all-reduce of partial sums,
a stage's stash) in the compute dtype; parameters, their gradients (all-reduced over data and
pipe) and Adam's second moment in the storage dtype; the first moment in `optimizer.mu_dtype`
when set. All float32 (4 bytes each) by default.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from semijax.core import precision as precision_lib
from semijax.core import spec as spec_lib


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Bytes of one value of each kind a training step stores or sends.

  Attributes:
    compute: a value in the compute dtype: an activation (what a stage boundary and a tensor
      all-reduce carry per element, what a stage stashes) and a weight as a block reads it
      (what offloading a unit sends).
    param: a stored parameter (param_dtype).
    grad: a parameter's gradient (param_dtype: weights are cast where a block reads them, so
      their gradients arrive in the storage dtype): what the data-parallel all-reduce carries.
    mu, nu: Adam's first moment (optimizer.mu_dtype, or param_dtype) and second (param_dtype).
  """

  compute: int = 4
  param: int = 4
  grad: int = 4
  mu: int = 4
  nu: int = 4

  def __post_init__(self):
    for f in dataclasses.fields(self):
      v = getattr(self, f.name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"StateBytes.{f.name}: must be an integer >= 1, got {v!r}")

  @classmethod
  def of(cls, precision: precision_lib.Precision = precision_lib.Precision(),
         mu_dtype: str = "") -> "StateBytes":
    """The bytes of a model in `precision` trained with Adam's first moment in `mu_dtype`
    ("": the parameters' dtype, as `train.optimizer.OptimizerSpec.mu_dtype`)."""
    if mu_dtype not in precision_lib.MU_DTYPES:
      raise ValueError(f"mu_dtype: {mu_dtype!r} is not '' or one of {precision_lib.DTYPES}")
    param = precision.param_bytes
    mu = jnp.dtype(mu_dtype).itemsize if mu_dtype else param
    return cls(compute=precision.compute_bytes, param=param, grad=param, mu=mu, nu=param)

  @property
  def state(self) -> int:
    """Bytes per parameter a device holds between steps (the parameter and both moments): what
    the planner's memory check counts and what a migration moves with a unit."""
    return self.param + self.mu + self.nu


@dataclasses.dataclass(frozen=True)
class ModelCosts:
  """A model's costs (see module doc).

  Attributes:
    num_layers: L; d_model; seq_len: tokens per example the blocks see.
    num_units: {kind: U}; flops_per_unit: {kind: forward FLOPs per token of one unit}.
    unit_params: {kind: parameters of one unit in one layer}.
    layer_params, first_params, last_params: parameters every device of a stage holds per
      layer, of the embedding, of the final norm and head.
    device_gflops: GFLOP/s of a device at speed 1.
    first_flops, last_flops: forward FLOPs per token of the embedding and of the final norm,
      head and loss (0: not charged).
    nbytes: bytes per activation, parameter, gradient and moment (default float32).
  """

  num_layers: int
  d_model: int
  seq_len: int
  num_units: dict
  flops_per_unit: dict
  unit_params: dict
  layer_params: int
  first_params: int
  last_params: int
  device_gflops: float
  first_flops: float = 0.0
  last_flops: float = 0.0
  nbytes: StateBytes = StateBytes()

  def __post_init__(self):
    if not self.device_gflops > 0:
      raise ValueError(f"device_gflops: must be positive, got {self.device_gflops}")
    for name in ("num_layers", "d_model", "seq_len"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")

  @classmethod
  def from_spec(cls, spec: spec_lib.ModelSpec, device_gflops: float,
                mu_dtype: str = "") -> "ModelCosts":
    """The costs of a `semijax.models` model ("gpt" or "vit"), in its precision, trained with
    Adam's first moment in `mu_dtype` ("": the parameters' dtype)."""
    d, f = spec.d_model, spec.kwargs
    layer_params = 6 * d         # two LayerNorms and the output biases
    if spec.name == "gpt":
      first = (f["vocab_size"] + spec.seq_len) * d
      last = 2 * d + d * f["vocab_size"]
    elif spec.name == "llama":   # the embedding; the final RMSNorm and the head (none if tied)
      first = f["vocab_size"] * d
      last = d + (0 if f["tie_embeddings"] else d * f["vocab_size"])
      layer_params = 2 * d       # two RMSNorms
    elif spec.name == "vit":
      patch_in = f["patch_size"] ** 2 * f["channels"]
      first = (patch_in + 1) * d + d + spec.seq_len * d
      last = 2 * d + d * f["num_classes"] + f["num_classes"]
    else:
      raise ValueError(f"spec.name: the planner knows the parameters of 'gpt', 'vit' and "
                       f"'llama', got {spec.name!r}")
    edge = spec.edge_flops()
    return cls(num_layers=spec.num_layers, d_model=d, seq_len=spec.seq_len,
               num_units=dict(spec.num_units()), flops_per_unit=dict(spec.flops_per_unit()),
               unit_params=dict(spec.unit_params()),
               layer_params=layer_params, first_params=first, last_params=last,
               device_gflops=float(device_gflops), first_flops=edge["first"],
               last_flops=edge["last"], nbytes=StateBytes.of(spec.precision, mu_dtype))

  @property
  def kinds(self) -> tuple[str, ...]:
    return tuple(self.num_units)

  def unit_ms(self, tokens: int) -> dict:
    """{kind: forward milliseconds of one unit of one layer for `tokens` tokens at speed 1}."""
    return {k: f * tokens / (self.device_gflops * 1e9) * 1e3
            for k, f in self.flops_per_unit.items()}

  def unit_s(self, tokens: int) -> dict:
    """`unit_ms` in seconds."""
    return {k: v * 1e-3 for k, v in self.unit_ms(tokens).items()}

  def edge_s(self, tokens: int, stages: int) -> np.ndarray:
    """float [stages]: forward seconds at speed 1 of the unsplit work outside the blocks on each
    stage for `tokens` tokens: the embedding on the first, the head on the last (both on one)."""
    out = np.zeros(stages)
    rate = self.device_gflops * 1e9
    out[0] += self.first_flops * tokens / rate
    out[-1] += self.last_flops * tokens / rate
    return out

  def activation_bytes(self, tokens: int) -> float:
    """Bytes of one microbatch's activations at a layer boundary: tokens x d_model in the
    compute dtype (what a tensor all-reduce and a stage boundary carry, and what a stage stashes
    per microbatch)."""
    return float(tokens * self.d_model * self.nbytes.compute)

  def max_tensor(self) -> int:
    """The largest tensor group: every device needs at least one unit of every kind."""
    return min(self.num_units.values())

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)
