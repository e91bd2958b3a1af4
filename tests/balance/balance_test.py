"""Balancing policies in real training runs (8 fake devices, emulated slowdown of device 0).

Migration and offload are lossless, so their losses must match the even run's; every policy
must compile nothing inside training steps after warm-up; decisions are logged with reasons.
"""

import json
import os

import jax
import numpy as np
import pytest

from helpers import tiny_gpt
from semijax.balance import coordinator as balance
from semijax.train import config as config_lib
from semijax.train import loop as train

SLOWDOWN = (4.0, 1.0, 1.0, 1.0)


def run(tmp_path, policy, **balance_fields):
  c = tiny_gpt(tensor=4, steps=8)
  c.hetero.slowdown = SLOWDOWN
  c.balance.policy = policy
  c.balance.patience = 1
  c.balance.min_dwell_steps = 1
  c.balance.num_widths = 8       # widths 4, 8, ..., 32: room for an uneven split
  for k, v in balance_fields.items():
    c.balance[k] = v
  workdir = str(tmp_path / policy)
  return train.train_and_evaluate(c, workdir), workdir


def decisions(workdir):
  with open(os.path.join(workdir, "decisions.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def even(tmp_path_factory):
  summary, _ = run(tmp_path_factory.mktemp("even"), "even")
  return summary


@pytest.mark.slow
def test_migrate_moves_work_off_the_slow_device_without_loss(tmp_path, even):
  summary, workdir = run(tmp_path, "migrate")
  b = summary["balance"]
  assert b["migrations"] >= 1 and b["compiles_after_warmup"] == 0
  # The even start runs the single-width step, the migrated split the branched one.
  assert 1 <= b["single_width_steps"] < 8 and even["balance"]["single_width_steps"] == 8
  mlp = b["layout_counts"]["mlp"]
  assert mlp[0] < min(mlp[1:]) and sum(mlp) == 64
  np.testing.assert_allclose(summary["losses"], even["losses"], rtol=1e-5)
  np.testing.assert_allclose(summary["val/loss"], even["val/loss"], rtol=1e-5)
  records = decisions(workdir)
  moved = [r for r in records if r["moves"]]
  assert moved and "migrate predicted" in moved[0]["reason"]
  assert all({"predicted_s", "measured_s", "speeds", "owned"} <= set(r) for r in records)
  assert moved[0]["speeds"][0] == pytest.approx(0.25)


@pytest.mark.slow
def test_offload_is_exact_and_compiles_nothing_after_warmup(tmp_path, even):
  summary, workdir = run(tmp_path, "offload")
  b = summary["balance"]
  assert b["compiles_after_warmup"] == 0 and b["migrations"] == 0
  offloaded = [r for r in decisions(workdir) if r["choice"] == "offload"]
  assert offloaded and offloaded[-1]["computed"]["mlp"][0] < 16 == offloaded[-1]["owned"]["mlp"][0]
  np.testing.assert_allclose(summary["losses"], even["losses"], rtol=1e-5)


@pytest.mark.slow
def test_semi_resizes_a_short_slowdown(tmp_path, even):
  # No room to migrate (capacity = the even share) and a horizon longer than the run: resizing
  # the slow device is the only faster option.
  summary, workdir = run(tmp_path, "semi", resize_horizon_steps=1000, capacity_factor=1.0)
  b = summary["balance"]
  assert b["compiles_after_warmup"] == 0
  records = decisions(workdir)
  assert any(r["choice"] == "resize" and r["keep"][0] < 1 for r in records)
  # Resizing changes the computation: the losses leave the even run's.
  assert not np.allclose(summary["losses"], even["losses"], rtol=1e-5)


def test_bucket_layout_and_rebalance():
  layout = config_lib.validate(tiny_gpt(tensor=4)).layout
  big = balance.bucket_layout(layout, 2.0, 4)
  assert big.mlp.capacity == 32 and big.mlp.counts == (16, 16, 16, 16)
  assert big.heads.capacity == 4 and big.mlp.widths == (8, 16, 24, 32)
  new = balance.rebalance(big, {"mlp": (4, 20, 20, 20), "heads": (2, 2, 2, 2)})
  assert new.mlp.counts == (4, 20, 20, 20) and new.mlp.capacity == 32
  # Only the 12 surplus units of device 0 moved; the others kept theirs.
  for d in (1, 2, 3):
    assert set(big.mlp.owned[d]) <= set(new.mlp.owned[d])
  assert sorted(u for o in new.mlp.owned for u in o) == list(range(64))
  # The tight bucket of the even split: capacity 16, the big bucket's widths below it.
  tight = balance.tight_layout(big)
  assert tight.mlp.capacity == 16 and tight.mlp.widths == (8, 16)
  assert tight.mlp.owned == big.mlp.owned
  assert balance.bucket_like(tight, new).mlp.capacity == 32
  assert balance.bucket_like(tight, new).mlp.owned == tight.mlp.owned


def test_migrations_switch_buckets_and_keep_the_state():
  # migrate starts in the tight bucket; an uneven split re-lays the state out in the big bucket,
  # the even split brings it back; the logical state never changes.
  c = tiny_gpt(tensor=4)
  c.balance.policy = "migrate"
  parsed = config_lib.validate(c)
  engine = train.build_engine(c, parsed)
  layout = balance.Balancer.initial_layout(c, parsed)
  assert layout.mlp.capacity == 16 and layout.heads.capacity == 2
  b = balance.Balancer(c, parsed, engine, layout, None, 100)
  state = engine.init(0, layout)
  want = jax.device_get(engine.to_logical(state, layout))
  state = b._migrate(state, {"mlp": (4, 20, 20, 20), "heads": (2, 2, 2, 2)})
  assert b.layout.mlp.capacity == 32 and b.layout.mlp.counts == (4, 20, 20, 20)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(engine.to_logical(state, b.layout)),
               want)
  state = b._migrate(state, {"mlp": (16, 16, 16, 16), "heads": (2, 2, 2, 2)})
  assert b.layout.bucket() == layout.bucket() and b.layout.mlp.counts == (16, 16, 16, 16)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(engine.to_logical(state, b.layout)),
               want)
  assert b.stats["migrations"] == 2


def test_rotating_slowdown_profile():
  assert balance.slowdown_at((8, 1, 1), 0, 5) == (8, 1, 1)
  assert balance.slowdown_at((8, 1, 1), 5, 5) == (1, 8, 1)
  assert balance.slowdown_at((8, 1, 1), 14, 5) == (1, 1, 8)
  assert balance.slowdown_at((8, 1, 1), 14, 0) == (8, 1, 1)


@pytest.mark.parametrize("field,value,match", [
    ("balance.policy", "fastest", "config.balance.policy"),
    ("balance.capacity_factor", 0.5, "config.balance.capacity_factor"),
    ("balance.measure", "guess", "config.balance.measure"),
    ("hetero.rotate_every", -1, "config.hetero.rotate_every"),
])
def test_bad_balance_config_is_refused(field, value, match):
  c = tiny_gpt(tensor=4)
  section, key = field.split(".")
  c[section][key] = value
  with pytest.raises(config_lib.ConfigError, match=match):
    config_lib.validate(c)


def test_conflicting_balance_settings_are_refused():
  c = tiny_gpt(tensor=4, mlp=(10, 30, 4, 20))
  c.balance.policy = "even"
  with pytest.raises(config_lib.ConfigError, match="config.layout.mlp"):
    config_lib.validate(c)
  c = tiny_gpt(tensor=4)
  c.balance.policy, c.resize.straggler = "semi", "rotate"
  with pytest.raises(config_lib.ConfigError, match="config.resize"):
    config_lib.validate(c)
  c = tiny_gpt(tensor=4)
  c.balance.measure = "emulated"
  with pytest.raises(config_lib.ConfigError, match="hetero.slowdown"):
    config_lib.validate(c)
