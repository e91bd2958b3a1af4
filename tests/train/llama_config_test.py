"""configs/llama_tiny.py trains through the one training loop: its :cpu variant learns, a
checkpoint restores onto another KV-group layout and device count exactly, a layout.heads that
does not count KV groups is refused by name, saying what it counts, and the demo's three runs
take it (the speed-proportional split counts KV groups)."""

import numpy as np
import pytest

import helpers as H
from benchmarks import demo
from semijax.errors import ConfigError
from semijax.train import config as config_lib
from semijax.train import loop as train


def tiny_llama(tensor=4, steps=6, **layout):
  """llama_tiny:cpu shrunk so a run compiles in seconds: 4 KV groups of 2 query heads."""
  return H.tiny_run("llama_tiny", dict(seq_len=16, d_model=32, num_heads=8, num_kv_heads=4,
                                       d_ff=64, num_layers=1), tensor, steps, **layout)


def test_the_cpu_variant_is_gpt_tiny_sized_and_learns(tmp_path):
  full = config_lib.validate(H.load("llama_tiny", "cpu"))
  gpt = config_lib.validate(H.load("gpt_tiny", "cpu"))
  params = lambda run: sum(run.model.unit_params()[k] * n for k, n in
                           run.model.num_units().items()) * run.model.num_layers
  assert full.model.num_units() == {"mlp": 344, "heads": 8}
  assert 0.8 < params(full) / params(gpt) < 1.0
  summary = train.train_and_evaluate(tiny_llama(steps=8), str(tmp_path))
  assert summary["losses"][-1] < summary["losses"][0] - 0.3


def test_restore_onto_another_kv_group_layout_and_device_count(tmp_path, monkeypatch):
  # Layout A on 4 devices (device 1 owns no KV group), interrupted after the step-3 checkpoint;
  # continued on 8 devices, four of which own no group. Losses match the run that never moved.
  layout_a = dict(mlp=(10, 30, 4, 20), heads=(2, 0, 1, 1))
  layout_b = dict(mlp=(8, 8, 8, 1, 12, 9, 9, 9), heads=(1, 0, 1, 0, 0, 1, 0, 1))
  reference = train.train_and_evaluate(tiny_llama(**layout_a), str(tmp_path / "ref"))
  workdir = str(tmp_path / "run")
  H.interrupted(monkeypatch, lambda: train.train_and_evaluate(tiny_llama(**layout_a), workdir),
                3)
  moved = train.train_and_evaluate(tiny_llama(tensor=8, **layout_b), workdir)
  assert moved["start_step"] == 3
  np.testing.assert_allclose(moved["losses"], reference["losses"][3:], rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(moved["val/loss"], reference["val/loss"], rtol=2e-6)


@pytest.mark.parametrize("heads, message", [
    ("2,2,2,2", r"^config\.layout\.heads: counts \(2, 2, 2, 2\) sum to 8, but the model has 4 "
                r"heads units \(for model 'llama', layout\.heads counts KV groups: "
                r"model\.num_kv_heads = 4\)$"),
    ("even", None),
])
def test_layout_heads_counts_kv_groups(heads, message):
  config = tiny_llama(heads=heads)
  if message is None:
    assert config_lib.validate(config).layout.heads.counts == (1, 1, 1, 1)
    return
  with pytest.raises(ConfigError, match=message):
    config_lib.validate(config)


def test_the_demo_takes_the_llama_config():
  cfgs = demo.configs(steps=2, slow_device=3, factor=4.0,
                      config_path=f"{H.ROOT}/configs/llama_tiny.py:cpu")
  runs = {name: config_lib.validate(c, num_devices=8) for name, c in cfgs.items()}
  assert {r.model.name for r in runs.values()} == {"llama"}
  heads = runs["proportional"].layout.heads.counts
  mlp = runs["proportional"].layout.mlp.counts
  assert sum(heads) == 8 and mlp[3] < min(mlp[:3] + mlp[4:])
  assert runs["semi"].balance.policy == "semi"


def test_the_controller_migrates_kv_groups_off_a_straggler_without_changing_the_losses(
    tmp_path):
  # Device 0, emulated 4x slower, starts with two KV groups: the migrate policy moves units and
  # groups off it once warm-up has measured the speeds, and training goes on exactly as on the
  # even split.
  even = train.train_and_evaluate(tiny_llama(steps=5), str(tmp_path / "even"))
  config = tiny_llama(steps=5, heads=(2, 1, 1, 0))
  config.balance.policy = "migrate"
  config.hetero.slowdown = (4.0, 1.0, 1.0, 1.0)
  moved = train.train_and_evaluate(config, str(tmp_path / "moved"))
  counts = moved["balance"]["layout_counts"]
  assert moved["balance"]["migrations"] >= 1
  assert counts["mlp"][0] < min(counts["mlp"][1:])
  assert counts["heads"][0] < 2 and sum(counts["heads"]) == 4
  np.testing.assert_allclose(moved["losses"], even["losses"], rtol=2e-6, atol=2e-6)
