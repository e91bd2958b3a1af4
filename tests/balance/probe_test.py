"""The speed probe: the model's MLP block in its compute dtype, against numpy, and every
device's program dispatched before any is waited for, each timed from its own dispatch."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from semijax.balance import probe as probe_lib
from semijax.core import precision
from semijax.models import gpt


def reference(x, w_in, w_out, repeats):
  """The probe's work in numpy (float64): x <- tanh(tanh(x @ w_in) @ w_out), `repeats` times."""
  x, w_in, w_out = (np.asarray(a, np.float64) for a in (x, w_in, w_out))
  for _ in range(repeats):
    x = np.tanh(np.tanh(x @ w_in) @ w_out)
  return x


def test_the_model_shaped_probe_is_one_devices_mlp_block_in_the_compute_dtype():
  spec = dataclasses.replace(
      gpt.GPT.spec(vocab_size=256, seq_len=64, d_model=32, num_heads=4, d_ff=96, num_layers=2),
      precision=precision.Precision(dtype="bfloat16"))
  shape = probe_lib.ProbeShape.of_block(spec, tokens=4 * 64, tensor=4)
  assert shape == probe_lib.ProbeShape(rows=256, d_model=32, width=24, dtype="bfloat16")
  assert shape.flops == 4 * 256 * 32 * 24              # two GEMMs, 2 FLOPs a multiply-add
  assert probe_lib.ProbeShape.of_block(spec, 10 ** 9, 4).rows == probe_lib.MAX_ROWS
  assert probe_lib.ProbeShape.configured(0, shape) == shape
  assert probe_lib.ProbeShape.configured(5, shape) == probe_lib.ProbeShape(5, 5, 5)
  devices = jax.local_devices()[:2]
  probe = probe_lib.Probe(shape, repeats=3, devices=devices)
  assert probe.flops == 3 * shape.flops
  for args, device in zip(probe._inputs, devices):
    assert [(a.shape, a.dtype) for a in args[:3]] == [((256, 32), jnp.bfloat16),
                                                     ((32, 24), jnp.bfloat16),
                                                     ((24, 32), jnp.bfloat16)]
    assert all(a.devices() == {device} for a in args)
    got = probe._fn(*args)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float64), reference(*args[:3], 3), atol=0.05)
  f32 = probe_lib.Probe(probe_lib.ProbeShape(7, 5, 3), repeats=2, devices=devices[:1])
  np.testing.assert_allclose(np.asarray(f32._fn(*f32._inputs[0])),
                             reference(*f32._inputs[0][:3], 2), rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="probe_repeats"):
    probe_lib.Probe(shape, repeats=0, devices=devices)


def test_the_passes_are_an_argument_of_one_program_and_fit_a_budget():
  device = jax.local_devices()[0]
  probe = probe_lib.Probe(probe_lib.ProbeShape(7, 5, 3), repeats=1, devices=[device])
  for repeats in (1, 4, 2):
    probe.set_repeats(repeats)
    assert probe.flops == repeats * probe.shape.flops
    np.testing.assert_allclose(np.asarray(probe._fn(*probe._inputs[0])),
                               reference(*probe._inputs[0][:3], repeats), rtol=1e-5, atol=1e-6)
  assert probe._fn._cache_size() == 1       # one compiled program for every count of passes
  times = probe.pass_seconds(tries=2)
  assert list(times) == [device.id] and times[device.id] > 0
  assert probe.repeats == 2                 # sizing left the passes as they were
  assert probe_lib.passes_for(0.010, 0.0025) == 4
  assert probe_lib.passes_for(0.010, 0.004) == 2
  assert probe_lib.passes_for(0.001, 0.004) == 1      # at least one pass
  assert probe_lib.passes_for(10.0, 0.001) == probe_lib.MAX_PASSES
  assert probe_lib.passes_for(0.01, 0.0) == 1
  with pytest.raises(ValueError, match="probe_repeats"):
    probe.set_repeats(1.5)


def test_every_device_is_dispatched_before_any_is_waited_for_and_timed_from_its_dispatch(
    monkeypatch):
  devices = jax.local_devices()[:3]
  probe = probe_lib.Probe(probe_lib.ProbeShape(8, 4, 4), devices=devices)
  probe.warm_up()
  events = []
  starts = iter([10.0, 10.5, 11.0])
  ends = {devices[0].id: 14.0, devices[1].id: 11.25, devices[2].id: 12.0}

  def clock():
    events.append("dispatch")
    return next(starts)

  def finish(out):
    events.append("wait")
    (device,) = out.devices()
    return ends[device.id]

  monkeypatch.setattr(probe_lib, "time", types.SimpleNamespace(perf_counter=clock))
  monkeypatch.setattr(probe, "_finish", finish)
  got = probe.measure()
  assert events == ["dispatch"] * 3 + ["wait"] * 3
  # Device 1 finished before device 0: waited for one after another it would read 4.0 s too.
  assert got == {devices[0].id: 4.0, devices[1].id: 0.75, devices[2].id: 1.0}
  probe.close()


def test_a_real_probe_times_every_device():
  devices = jax.local_devices()[:4]
  probe = probe_lib.Probe(probe_lib.ProbeShape(64, 32, 32), repeats=2, devices=devices)
  probe.warm_up()
  for _ in range(2):
    times = probe.measure()
    assert sorted(times) == sorted(d.id for d in devices)
    assert all(0 < t < 10 for t in times.values())
  probe.close()
  assert probe._pool is None
  one = probe_lib.Probe(probe_lib.ProbeShape(8, 8, 8), devices=devices[:1])
  assert list(one.measure()) == [devices[0].id] and one._pool is None
