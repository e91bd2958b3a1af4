"""How a model computes, beyond what it holds: the compute dtype, the storage dtype, the attention
kernel and the rematerialization policy (none of them changes what a checkpoint holds).

Names follow MaxText: `dtype` is what the blocks compute in (activations, GEMM inputs and
outputs, the tensor all-reduce of partial sums), `param_dtype` what parameters are stored in
(the master weights the optimizer updates). Weights are cast to `dtype` where a block reads them,
so their gradients arrive in `param_dtype`. Whatever `dtype` is, the LayerNorm statistics, the
attention softmax, the logits and the loss are float32.

`attention` picks the implementation of `jax.nn.dot_product_attention`: "xla" (einsums and a
softmax, every backend), "cudnn" (the fused cuDNN kernel: a CUDA GPU, bfloat16 or float16, head
dimension a multiple of 8 up to 128) or "auto" (cuDNN where it applies, else XLA).

`remat_policy` says which activations a training step keeps for its backward pass and which it
recomputes (`core.remat`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from semijax.core import remat
from semijax.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
# Adam's first-moment dtype (`optimizer.mu_dtype`): "" = the parameters', or one of DTYPES.
MU_DTYPES = ("",) + DTYPES
ATTENTION = ("xla", "cudnn", "auto")
_HALF = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Precision:
  """`config.model.dtype`, `.param_dtype`, `.attention` and `.remat_policy` (see module doc)."""

  dtype: str = "float32"
  param_dtype: str = "float32"
  attention: str = "auto"
  remat_policy: str = "none"

  def validate(self, backend: str | None = None) -> "Precision":
    """Raises ConfigError naming the bad field; `backend` (jax.default_backend()), when given,
    is checked against dtype="float16" (not on CPU) and attention="cudnn" (CUDA only)."""
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in DTYPES:
        raise ConfigError(f"config.model.{name}: {getattr(self, name)!r} is not one of {DTYPES}")
    if self.dtype == "float16" and backend == "cpu":
      raise ConfigError("config.model.dtype: 'float16' does not run on the CPU backend (XLA:CPU "
                        "has no float16 GEMM accumulating into float32); use 'bfloat16' or "
                        "'float32'")
    if self.attention not in ATTENTION:
      raise ConfigError(f"config.model.attention: {self.attention!r} is not one of {ATTENTION}")
    if self.remat_policy not in remat.POLICIES:
      raise ConfigError(f"config.model.remat_policy: {self.remat_policy!r} is not one of "
                        f"{remat.POLICIES}")
    if self.attention == "cudnn" and self.dtype not in _HALF:
      raise ConfigError(f"config.model.attention: 'cudnn' needs model.dtype bfloat16 or float16, "
                        f"got {self.dtype!r}; use 'auto' or 'xla'")
    if self.attention == "cudnn" and backend is not None and backend != "gpu":
      raise ConfigError(f"config.model.attention: 'cudnn' needs a CUDA GPU, but the backend is "
                        f"{backend!r}; use 'auto' or 'xla'")
    return self

  @property
  def compute(self) -> jnp.dtype:
    return jnp.dtype(self.dtype)

  @property
  def storage(self) -> jnp.dtype:
    return jnp.dtype(self.param_dtype)

  @property
  def compute_bytes(self) -> int:
    """Bytes of one activation value (and of a weight as a block reads it)."""
    return self.compute.itemsize

  @property
  def param_bytes(self) -> int:
    """Bytes of one stored parameter."""
    return self.storage.itemsize

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  def attention_impl(self, head_dim: int) -> str:
    """"xla" or "cudnn": what `attention` means on this backend, for heads of `head_dim`."""
    if self.attention != "auto":
      return self.attention
    fused = self.dtype in _HALF and head_dim % 8 == 0 and head_dim <= 128 and _cuda()
    return "cudnn" if fused else "xla"


def _cuda() -> bool:
  """Whether the default backend is a CUDA GPU (ROCm GPUs report "gpu" too, without cuDNN)."""
  if jax.default_backend() != "gpu":
    return False
  return "rocm" not in str(jax.devices()[0].client.platform_version).lower()


def cast(x, dtype):
  """`x` in `dtype` (the identity when it already is)."""
  return x if x.dtype == dtype else x.astype(dtype)
