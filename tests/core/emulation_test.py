"""Emulated heterogeneity: the profile over time and its validation."""

import numpy as np
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
    (emulation.Hetero(repeated=1), r"repeated: must be True or False, got 1"),
])
def test_bad_emulation_settings_name_their_field(hetero, match):
  with pytest.raises(ConfigError, match=r"^config\.hetero\." + match):
    hetero.validate(2)


def test_delay_is_the_sum_over_blocks_of_the_slowest_device():
  # 2 devices, 2 layers; mlp widths executed (8, 4) in layer 0 and (8, 8) in layer 1, heads
  # (2, 1) in both; device 1 is 3x slower. Per block, the slowest device's time:
  #   mlp  layer 0: max(1*8*1, 1*4*3) = 12; layer 1: max(8, 24) = 24
  #   heads each layer: max(10*2*1, 10*1*3) = 30
  emu = emulation.Emulator(emulation.Hetero((1.0, 3.0)), {"mlp": 1.0, "heads": 10.0})
  executed = {"mlp": np.array([[8, 8], [4, 8]]), "heads": np.array([[2, 2], [1, 1]])}
  assert emu.delay_s(0, executed) == pytest.approx((12 + 24 + 30 + 30) / 1e3)
  # Rotated profile (every step): device 0 is the slow one at step 1.
  emu = emulation.Emulator(emulation.Hetero((1.0, 3.0), rotate_every=1), {"mlp": 1.0,
                                                                          "heads": 10.0})
  assert emu.delay_s(1, executed) == pytest.approx((24 + 24 + 60 + 60) / 1e3)



def test_repeated_work_is_charged_on_the_slowest_device_that_runs_it():
  # 3 devices, 1 layer, speeds slowed (1, 2, 100): device 2 owns units (3 MLP, 1 head), then
  # none (drained). The embedding (5 ms) and the head and loss (7 ms): (5 + 7) * 100 = 1200
  # while device 2 runs blocks, (5 + 7) * 2 = 24 once it is drained.
  # Blocks: max(4, 4 * 2, 3 * 100) = 300 (mlp) + max(10, 10 * 2, 10 * 100) = 1000 (heads),
  # then max(6, 6 * 2, 0) = 12 + max(10 * 2, 10 * 2 * 2, 0) = 40.
  emu = emulation.Emulator(emulation.Hetero((1.0, 2.0, 100.0)), {"mlp": 1.0, "heads": 10.0},
                           {"first": 5.0, "last": 7.0})
  owning = {"mlp": np.array([[4], [4], [3]]), "heads": np.array([[1], [1], [1]])}
  drained = {"mlp": np.array([[6], [6], [0]]), "heads": np.array([[2], [2], [0]])}
  assert emu.delay_s(0, owning) == pytest.approx((300 + 1000 + 1200) / 1e3)
  assert emu.delay_s(0, drained) == pytest.approx((12 + 40 + 24) / 1e3)
  # A device with heads but no MLP units is not drained: it still runs the embedding and head.
  half = {"mlp": np.array([[6], [6], [0]]), "heads": np.array([[1], [1], [1]])}
  assert emu.delay_s(0, half) == pytest.approx((12 + 1000 + 1200) / 1e3)

def test_unit_ms_charges_forward_and_backward():
  # mlp: 4e3 forward FLOPs a token x 1000 tokens = 4e6; with the backward's 8e6, 1.2e7 FLOPs at
  # 2 GFLOP/s take 6 ms. heads: 1e4 x 1000 x 3 = 3e7 FLOPs, 15 ms.
  ms = emulation.unit_ms({"mlp": 4e3, "heads": 1e4}, tokens_per_device=1000, device_gflops=2.0)
  assert ms == pytest.approx({"mlp": 6.0, "heads": 15.0})
  with pytest.raises(ValueError, match="device_gflops"):
    emulation.unit_ms({"mlp": 4e3}, tokens_per_device=1000, device_gflops=0.0)
