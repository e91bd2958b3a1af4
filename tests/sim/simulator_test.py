"""The simulator runs the library's own decision code on simulated time."""

import dataclasses

import numpy as np
import pytest

from semijax.balance import controller as controller_lib
from semijax.balance import settings as settings_lib
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import migrate as migrate_lib
from semijax.core.precision import Precision
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware
from semijax.sim import simulator
from semijax.sim import stage as stage_lib
from semijax.sim import stepcost
from semijax.sim import strategies
from semijax.sim import traces
from semijax.sim import workload as workload_lib

HW = hardware.Hardware("t", device_flops=2e9, branch_overhead=0.1, step_overhead_s=0.01,
                       move_fixed_s=0.05, sample_s=0.001)


def workload():
  return workload_lib.Workload.gpt(d_model=64, num_heads=8, d_ff=256, num_layers=2, seq_len=32,
                                   vocab_size=64, batch_per_replica=8)


def run_of(policy, steps=60, data=1, counts=None, hw=HW, **kw):
  return simulator.Run(workload(), cluster_lib.Cluster(data, 1, 4), hw,
                       settings_lib.BalanceSettings(policy=policy, num_widths=8, probe_every=2,
                                                    **kw), steps, static_counts=counts)


def slow_trace(data=1, device=1, speed=0.25):
  return traces.Trace(4 * data, 1, [[0.0, device, speed]])


def test_even_under_a_straggler_is_as_slow_as_its_straggler():
  fast = simulator.simulate(run_of("even"), traces.Trace(4))
  slow = simulator.simulate(run_of("even"), slow_trace())
  assert slow.tokens_per_s < 0.5 * fast.tokens_per_s
  assert fast.tokens_per_s == pytest.approx(fast.ideal_tokens_per_s)


def test_migrate_moves_work_off_the_straggler_and_beats_even():
  even = simulator.simulate(run_of("even"), slow_trace())
  mig = simulator.simulate(run_of("migrate"), slow_trace())
  counts = mig.stages[0]["counts"]["mlp"]
  assert mig.stat("migrations") >= 1 and counts[1] == min(counts)
  assert mig.tokens_per_s > 1.3 * even.tokens_per_s
  oracle = stage_lib.oracle_counts(workload().spec, [1, 0.25, 1, 1])
  static = simulator.simulate(run_of("static", counts=(oracle,)), slow_trace())
  assert static.tokens_per_s > mig.tokens_per_s * 0.95             # the oracle moves nothing


def test_semi_drains_a_device_at_one_percent_and_runs_near_the_ideal():
  # One tensor group of 8; device 3 drops to 1% at step 20 and stays there. 56 heads and 448 MLP
  # units: the 7 others take exactly 8/7 of the even share, what the ideal (total work over total
  # speed 7.01 / 8) charges them, and the repeated work runs at full speed. So once device 3 is
  # drained a step takes at most the ideal's x (1 + branch_overhead) (the branched variant),
  # plus the speed sample every probe_every steps: with 0.05, at least 1 / 1.05 of the ideal.
  w = workload_lib.Workload.gpt(d_model=112, num_heads=56, d_ff=448, num_layers=2, seq_len=32,
                                vocab_size=64, batch_per_replica=8)
  c = cluster_lib.Cluster(1, 1, 8)
  hw = dataclasses.replace(HW, branch_overhead=0.05)
  trace = traces.Trace(8, 1, [[20, 3, 0.01]], unit="step")
  runs = {p: simulator.simulate(simulator.Run(w, c, hw, settings_lib.BalanceSettings(
      policy=p, num_widths=8, probe_every=2), 200), trace) for p in ("even", "semi")}
  semi = runs["semi"]
  assert semi.stages[0]["counts"] == {"mlp": [64, 64, 64, 0, 64, 64, 64, 64],
                                      "heads": [8, 8, 8, 0, 8, 8, 8, 8]}
  drain = semi.stages[0]["changes"][0]
  assert drain["reason"].startswith("drain device 3; ") and 20 < drain["step"] <= 20 + 3 * 2
  model = stepcost.StepModel(w, c, hw, strategies.make("sync"))
  ideal_step = simulator.nominal_step_s(model) / (7.01 / 8)
  after = semi.step_s[drain["step"] + 1:]
  bound = 1 / (1 + hw.branch_overhead + hw.sample_s / 2 / ideal_step)
  assert ideal_step * len(after) / after.sum() >= bound
  # Before it: the few steps that wait for the device at 1%, about 70 ideal steps each (even).
  even = runs["even"]
  assert even.tokens_per_s < 0.02 * even.ideal_tokens_per_s < semi.tokens_per_s


def test_bfloat16_storage_halves_what_a_migration_moves():
  """A migration moves each unit's weight and both Adam moments at their stored dtypes: 12
  bytes a parameter in float32, 6 in bfloat16, 8 with a float32 first moment; the activations'
  dtype does not enter."""
  hw = hardware.Hardware("m", device_flops=2e9, move_local_bytes_per_s=1e9, move_bytes_per_s=1e8)
  spec = workload().spec
  even = layout_lib.Layout.for_model(d_model=spec.d_model, num_heads=spec.num_heads,
                                     d_ff=spec.d_ff, num_devices=4)
  uneven = layout_lib.Layout.for_model(d_model=spec.d_model, num_heads=spec.num_heads,
                                       d_ff=spec.d_ff, num_devices=4, mlp=(96, 32, 64, 64),
                                       heads=(3, 1, 2, 2))
  moves = migrate_lib.plan(even, uneven)
  seconds = {}
  for name, kw in [("float32", {}), ("compute", {"dtype": "bfloat16"}),
                   ("stored", {"param_dtype": "bfloat16"})]:
    w = dataclasses.replace(workload(), spec=dataclasses.replace(spec, precision=Precision(**kw)))
    seconds[name] = simulator._move_seconds(hw, w, spec.num_layers, 4)(moves)
    seconds[name + "_mu32"] = simulator._move_seconds(
        hw, dataclasses.replace(w, mu_dtype="float32"), spec.num_layers, 4)(moves)
  # By hand for float32: the local gathers over a device's quarter of the units' state and the
  # wire slots' state, 12 bytes a parameter.
  per_unit = {"mlp": 12 * (2 * 64 + 1) * 2, "heads": 12 * (4 * 64 * 8 + 3 * 8) * 2}
  local = (per_unit["mlp"] * 256 + per_unit["heads"] * 8) / 4 / 1e9
  wire = sum(per_unit[k] * m.wire_slots for k, m in moves.kinds.items()) / 4 / 1e8
  assert wire > 0 and seconds["float32"] == pytest.approx(local + wire, rel=1e-12)
  assert seconds["compute"] == seconds["float32"] == seconds["float32_mu32"]
  assert seconds["stored"] == pytest.approx(seconds["float32"] / 2, rel=1e-12)
  assert seconds["stored_mu32"] == pytest.approx(seconds["float32"] * 8 / 12, rel=1e-12)


def test_with_data_parallelism_the_layout_follows_the_slowest_replica():
  # Replica 1's device 2 is slow; one layout serves both replicas (`speed.tensor_times`).
  mig = simulator.simulate(run_of("migrate", data=2), slow_trace(data=2, device=4 + 2))
  counts = mig.stages[0]["counts"]["mlp"]
  assert counts[2] == min(counts) and mig.stat("migrations") >= 1


def test_a_change_to_the_controller_changes_the_simulation(monkeypatch):
  before = simulator.simulate(run_of("semi"), slow_trace())
  assert before.stat("changes") > 0
  monkeypatch.setattr(controller_lib.Controller, "choose_with_hysteresis",
                      lambda self, o: (o.current, "patched: never change"))
  after = simulator.simulate(run_of("semi"), slow_trace())
  assert after.stat("changes") == 0 and after.tokens_per_s < before.tokens_per_s


def test_settings_reach_the_real_controller():
  # With an enormous hysteresis nothing is ever worth changing.
  frozen = simulator.simulate(run_of("migrate", hysteresis=0.99), slow_trace())
  assert frozen.stat("migrations") == 0


def test_an_emulated_replay_adds_the_library_emulators_sleep():
  hetero = emulation.Hetero((4.0, 1.0, 1.0, 1.0), 2.0, 0)
  hw = dataclasses.replace(HW, emulated=True, cores=2, step_noise=0.0)
  run = dataclasses.replace(run_of("even", steps=5, hw=hw), hetero=hetero)
  emu = simulator.simulate(run, traces.Trace(4))
  plain = simulator.simulate(dataclasses.replace(run, hetero=None,
                                                 hardware=dataclasses.replace(hw, emulated=False)),
                             traces.Trace(4))
  w = workload()
  executed = {"mlp": np.full((4, 2), 64.0), "heads": np.full((4, 2), 2.0)}
  ms = lambda flops: emulation.unit_ms(flops, w.tokens_per_replica, 2.0)
  # The blocks at the slowest device's 4x, and the repeated work (embedding, head and loss) too.
  blocks = 2 * 4 * (64 * ms(w.spec.flops_per_unit())["mlp"]
                    + 2 * ms(w.spec.flops_per_unit())["heads"])
  edge = 4 * sum(ms(w.spec.edge_flops()).values())
  assert np.allclose(emu.step_s - plain.step_s, (blocks + edge) / 1e3)
  # A replay of a run emulated without the repeated work charges the blocks alone.
  blocks_only = simulator.simulate(dataclasses.replace(
      run, hetero=dataclasses.replace(hetero, repeated=False)), traces.Trace(4))
  assert np.allclose(blocks_only.step_s - plain.step_s, blocks / 1e3)


def test_simulations_are_deterministic_per_seed():
  hw = dataclasses.replace(HW, sample_noise=0.05, step_noise=0.05)
  a = simulator.simulate(run_of("semi", hw=hw), slow_trace())
  b = simulator.simulate(run_of("semi", hw=hw), slow_trace())
  c = simulator.simulate(dataclasses.replace(run_of("semi", hw=hw), seed=1), slow_trace())
  assert np.array_equal(a.step_s, b.step_s) and not np.array_equal(a.step_s, c.step_s)


def test_a_trace_of_the_wrong_size_is_refused():
  with pytest.raises(ValueError, match="sim.trace: 8 devices for a cluster of 4"):
    simulator.simulate(run_of("even"), traces.Trace(8))
