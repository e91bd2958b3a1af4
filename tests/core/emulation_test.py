"""Emulated heterogeneity: the profile over time and its validation."""

import pytest

from semijax.core import emulation
from semijax.errors import ConfigError


def test_rotating_slowdown_profile():
  h = emulation.Hetero((8, 1, 1), rotate_every=5)
  assert h.slowdown_at(0) == (8, 1, 1)
  assert h.slowdown_at(5) == (1, 8, 1)
  assert h.slowdown_at(14) == (1, 1, 8)
  assert emulation.Hetero((8, 1, 1)).slowdown_at(14) == (8, 1, 1)
  assert emulation.Hetero().slowdown_at(3) is None


@pytest.mark.parametrize("hetero, match", [
    (emulation.Hetero((1.0, float("nan"))), r"slowdown: every factor must be a positive finite "
     r"number, got nan"),
    (emulation.Hetero((1.0, -2.0)), r"slowdown: every factor must be a positive"),
    (emulation.Hetero((1.0, 2.0, 3.0)), r"slowdown: 3 factors .* for mesh.tensor = 2 devices"),
    (emulation.Hetero(device_gflops=0.0), r"device_gflops: must be a positive number"),
    (emulation.Hetero(rotate_every=-1), r"rotate_every: must be an integer >= 0"),
])
def test_bad_emulation_settings_name_their_field(hetero, match):
  with pytest.raises(ConfigError, match=r"^config\.hetero\." + match):
    hetero.validate(2)
