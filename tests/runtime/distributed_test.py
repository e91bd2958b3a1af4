"""Joining a multi-process job: what is checked before jax.distributed is called."""

import pytest

from semijax import errors
from semijax.core import transport
from semijax.runtime import distributed


def test_a_bad_environment_value_stops_a_multiprocess_start_before_jax_is_touched(monkeypatch):
  calls = []
  monkeypatch.setattr(distributed.jax.distributed, "initialize",
                      lambda *a, **k: calls.append(a))
  monkeypatch.setenv(transport.ENV, "lowest")
  with pytest.raises(errors.InputError, match=f"{transport.ENV}: 'lowest'"):
    distributed.initialize("127.0.0.1:1", 2, 0)
  assert calls == []
  distributed.initialize()          # one process: nothing is read, nothing fails
