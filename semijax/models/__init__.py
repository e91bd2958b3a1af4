"""Models built from uneven tensor-parallel blocks, and the registry that names them.

A model class provides `FIELDS` (its config fields), `spec(**fields)` (a validated
`core.spec.ModelSpec`), `loss_terms` (`tasks`), `input_key` and the NNX module itself. Adding a
model is a module and one entry in `REGISTRY`.
"""

from __future__ import annotations

from semijax.core import spec as spec_lib
from semijax.errors import ConfigError
from semijax.models import gpt
from semijax.models import vit

REGISTRY = {"gpt": gpt.GPT, "vit": vit.ViT}


def model_class(name: str):
  if name not in REGISTRY:
    raise ConfigError(f"config.model.name: {name!r} is not one of {sorted(REGISTRY)}")
  return REGISTRY[name]


def spec(name: str, fields: dict) -> spec_lib.ModelSpec:
  """The validated `ModelSpec` of model `name` with config `fields` (without the name)."""
  return model_class(name).spec(**fields)


def build(spec: spec_lib.ModelSpec):
  """(model_fn(rngs) -> nnx.Module, loss_terms) for a spec."""
  cls = model_class(spec.name)
  kw = spec.kwargs
  return (lambda rngs: cls(rngs=rngs, **kw)), cls.loss_terms
