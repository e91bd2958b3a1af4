"""`config.profile`: a jax.profiler trace of the chosen steps in the workdir's TensorBoard
directory, and every step's model TFLOP/s per device and MFU in its record."""

import glob
import os

import jax
import numpy as np
import pytest

from helpers import tiny_gpt
from semijax.core import flops
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics


def test_the_chosen_steps_are_traced_and_every_record_has_its_tflops_and_mfu(tmp_path,
                                                                            capsys):
  config = tiny_gpt(steps=5)
  config.profile.start_step, config.profile.num_steps = 2, 2
  config.profile.peak_tflops = 1e-3            # a CPU has no entry in the table
  train.train_and_evaluate(config, str(tmp_path))
  traces = glob.glob(str(tmp_path / "tensorboard" / "plugins" / "profile" / "*" /
                         "*.xplane.pb"))
  assert len(traces) == 1 and os.path.getsize(traces[0]) > 0
  assert f"profile: steps 2-3 traced to {tmp_path / 'tensorboard'}" in capsys.readouterr().out
  run = config_lib.validate(config)
  per_example = flops.train_flops_per_example(run.model)
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5]
  for r in records:
    want = per_example * config.batch_size / r["train/step_time_s"] / jax.device_count() / 1e12
    np.testing.assert_allclose(r["train/tflops_per_device"], want, rtol=1e-9)
    np.testing.assert_allclose(r["train/mfu"], want / 1e-3, rtol=1e-9)


def test_without_a_known_peak_there_is_no_mfu_and_no_trace(tmp_path):
  train.train_and_evaluate(tiny_gpt(steps=2), str(tmp_path))
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert all(r["train/tflops_per_device"] > 0 and "train/mfu" not in r for r in records)
  assert not os.path.exists(tmp_path / "tensorboard" / "plugins")


@pytest.mark.parametrize("field, value, match", [
    ("num_steps", 0, r"^config.profile.num_steps: must be an integer >= 1, got 0"),
    ("start_step", -1, r"^config.profile.start_step: must be an integer >= 0, got -1"),
    ("start_step", 7, r"^config.profile.start_step: 7 is after the run's last step "
                      r"\(config.steps = 6\)"),
    ("peak_tflops", -2.0, r"^config.profile.peak_tflops: must be a number >= 0"),
])
def test_bad_profile_settings_are_refused_by_name(field, value, match):
  config = tiny_gpt(steps=6)
  config.profile[field] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(config)
