"""Checks of model config fields shared by the models' `spec` constructors."""

from __future__ import annotations

import numbers

from semijax.errors import ConfigError


def positive_fields(name: str, required: tuple[str, ...], fields: dict) -> dict:
  """`fields` restricted to `required`, each a positive integer (else ConfigError naming it)."""
  unknown = sorted(set(fields) - set(required))
  if unknown:
    raise ConfigError(f"config.model.{unknown[0]}: unknown field for model {name!r}; its fields "
                      f"are {list(required)}")
  out = {}
  for field in required:
    if field not in fields:
      raise ConfigError(f"config.model.{field}: missing (required for model {name!r})")
    v = fields[field]
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
      raise ConfigError(f"config.model.{field}: must be an integer >= 1, got {v!r}")
    out[field] = int(v)
  return out


def heads_divide_width(f: dict) -> None:
  if f["d_model"] % f["num_heads"]:
    raise ConfigError(f"config.model.num_heads: {f['num_heads']} heads do not divide the model "
                      f"width d_model={f['d_model']}")
