"""Balancing policies in real training runs (8 fake devices, emulated slowdown of device 0).

Migration and offload are lossless, so their losses must match the even run's; every policy
must compile nothing inside training steps after warm-up; decisions are logged with reasons.
"""

import json
import os
import types

import jax
import numpy as np
import pytest

from helpers import tiny_gpt
from semijax.balance import coordinator
from semijax.balance import mover as mover_lib
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import tensor as tensor_lib

SLOWDOWN = (4.0, 1.0, 1.0, 1.0)


def run(tmp_path, policy, slowdown=SLOWDOWN, **balance_fields):
  c = tiny_gpt(tensor=4, steps=8)
  c.hetero.slowdown = slowdown
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
  # Warm-up's trial step measured the slowdown, so the first step already runs the migrated
  # split (the branched step); the even run keeps the single-width one.
  assert b["single_width_steps"] == 0 and even["balance"]["single_width_steps"] == 8
  mlp = b["layout_counts"]["mlp"]
  assert mlp[0] < min(mlp[1:]) and sum(mlp) == 64
  np.testing.assert_allclose(summary["losses"], even["losses"], rtol=1e-5)
  np.testing.assert_allclose(summary["val/loss"], even["val/loss"], rtol=1e-5)
  records = decisions(workdir)
  moved = [r for r in records if r["moves"]]
  assert moved and "migrate predicted" in moved[0]["reason"] and moved[0]["step"] == 0
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
  # No room to migrate (capacity = the even share), a horizon longer than the run and a skip
  # budget that allows it from the start: resizing the slow device is the only faster option.
  summary, workdir = run(tmp_path, "semi", resize_horizon_steps=1000, capacity_factor=1.0,
                         skip_budget=0.9)
  b = summary["balance"]
  assert b["compiles_after_warmup"] == 0
  records = decisions(workdir)
  assert any(r["choice"] == "resize" and r["keep"][0] < 1 for r in records)
  # Resizing changes the computation: the losses leave the even run's.
  assert not np.allclose(summary["losses"], even["losses"], rtol=1e-5)


def test_semi_drains_a_device_at_one_percent_without_loss(tmp_path, even):
  summary, workdir = run(tmp_path, "semi", slowdown=(1.0, 1.0, 1.0, 100.0), drain=True)
  b = summary["balance"]
  assert b["compiles_after_warmup"] == 0 and b["migrations"] == 1
  assert b["layout_counts"]["mlp"][3] == 0 and b["layout_counts"]["heads"][3] == 0
  drained = [r for r in decisions(workdir) if r["moves"]]
  assert drained[0]["reason"].startswith("drain device 3; ") and drained[0]["drained"] == [3]
  np.testing.assert_allclose(summary["losses"], even["losses"], rtol=1e-5)
  np.testing.assert_allclose(summary["val/loss"], even["val/loss"], rtol=1e-5)


def test_migrations_switch_buckets_and_keep_the_state(monkeypatch):
  # migrate starts in the tight bucket; an uneven split re-lays the state out in the big bucket,
  # the even split brings it back; the logical state never changes. The mover's clock is
  # scripted: each move reports the seconds between its two readings, and the total adds up.
  reads = iter([10.0, 10.75, 30.0, 30.5])
  monkeypatch.setattr(mover_lib, "time", types.SimpleNamespace(perf_counter=lambda: next(reads)))
  c = tiny_gpt(tensor=4)
  c.balance.policy = "migrate"
  run = config_lib.validate(c)
  engine = train.build_engine(run)
  b = coordinator.Balancer.create(engine, settings=run.balance, resize_spec=run.resize,
                                  hetero=run.hetero, spec=run.model, layout=run.layout,
                                  workdir=None, steps_per_epoch=100, seed=0,
                                  tokens=tensor_lib.step_tokens(run))
  start = b.layout
  assert start.mlp.capacity == 16 and start.heads.capacity == 2
  state = engine.init(0, start)
  want = jax.device_get(engine.to_logical(state, start))
  uneven = b.buckets.target(start, {"mlp": (4, 20, 20, 20), "heads": (2, 2, 2, 2)})
  state, seconds = b.mover.timed_move(state, start, uneven)
  assert uneven.mlp.capacity == 32 and uneven.mlp.counts == (4, 20, 20, 20)
  assert seconds == 0.75
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(engine.to_logical(state, uneven)),
               want)
  back = b.buckets.target(uneven, {"mlp": (16, 16, 16, 16), "heads": (2, 2, 2, 2)})
  state, seconds = b.mover.timed_move(state, uneven, back)
  assert seconds == 0.5
  assert back.bucket() == start.bucket() and back.mlp.counts == (16, 16, 16, 16)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(engine.to_logical(state, back)),
               want)
  assert b.mover.moves == 2 and b.mover.seconds == 1.25


@pytest.mark.parametrize("field,value,match", [
    ("balance.policy", "fastest", "config.balance.policy"),
    ("balance.cost_memory", 0.5, "config.balance.cost_memory"),
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
