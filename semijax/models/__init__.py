"""Models built from uneven tensor-parallel blocks, and the registry that names them.

A model class provides `FIELDS` (its config fields), `spec(**fields)` (a validated
`core.spec.ModelSpec`), `loss_terms` (`tasks`), `input_key` and the NNX module itself. Adding a
model is a module and one entry in `REGISTRY`.
"""

from __future__ import annotations

import dataclasses

from semijax.core import precision as precision_lib
from semijax.core import spec as spec_lib
from semijax.errors import ConfigError
from semijax.models import gpt
from semijax.models import llama
from semijax.models import vit

REGISTRY = {"gpt": gpt.GPT, "vit": vit.ViT, "llama": llama.Llama}


def model_class(name: str):
  if name not in REGISTRY:
    raise ConfigError(f"config.model.name: {name!r} is not one of {sorted(REGISTRY)}")
  return REGISTRY[name]


# Config fields every model takes (`core.precision.Precision`), beside its own `FIELDS`.
PRECISION_FIELDS = tuple(f.name for f in dataclasses.fields(precision_lib.Precision))


def spec(name: str, fields: dict, backend: str | None = None) -> spec_lib.ModelSpec:
  """The validated `ModelSpec` of model `name` with config `fields` (without the name); the
  precision fields are optional (`PRECISION_FIELDS`), `backend` as in `Precision.validate`."""
  own = {k: v for k, v in fields.items() if k not in PRECISION_FIELDS}
  precision = precision_lib.Precision(**{k: v for k, v in fields.items()
                                         if k in PRECISION_FIELDS}).validate(backend)
  return dataclasses.replace(model_class(name).spec(**own), precision=precision)


def build(spec: spec_lib.ModelSpec):
  """(model_fn(rngs) -> nnx.Module, loss_terms) for a spec."""
  cls = model_class(spec.name)
  kw = spec.kwargs
  return (lambda rngs: cls(rngs=rngs, precision=spec.precision, **kw)), cls.loss_terms
