"""train_and_evaluate on a tensor-parallel run: configs, metrics, checkpoints (the newest
keep_checkpoints kept), re-layout on restore (resuming exactly and the NaN stop: loop_test)."""

import json
import os

import numpy as np
import pytest

import helpers as H
from helpers import load, tiny_gpt
from semijax.train import loop as train
from semijax.train import metrics
from semijax.errors import ConfigError


@pytest.mark.parametrize("name, unit", [("gpt_tiny", "tokens"), ("vit_digits", "images")])
def test_config_smoke(tmp_path, name, unit):
  # Validated every 2 steps, logged every 3 (and at every validation and the last step),
  # a checkpoint every 2 steps of which the newest is kept.
  config = load(name)
  config.steps, config.eval_every, config.log_every = 4, 2, 3
  config.checkpoint_every, config.keep_checkpoints = 2, 1
  summary = train.train_and_evaluate(config, str(tmp_path))
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [r["step"] for r in records] == [2, 3, 4]
  assert ["val/loss" in r for r in records] == [True, False, True]
  for r in records:
    assert r["train/loss"] == summary["losses"][r["step"] - 1]
    assert r["train/step_time_s"] == summary["step_times_s"][r["step"] - 1]
    assert r[f"train/{unit}_per_s"] > 0
  assert 0 <= records[-1]["val/accuracy"] <= 1 and summary["val/loss"] == records[-1]["val/loss"]
  tb = metrics.read_tensorboard(str(tmp_path / "tensorboard"))
  assert [s for s, _ in tb["train/loss"]] == [2, 3, 4]
  np.testing.assert_allclose([v for _, v in tb["train/loss"]],
                             [r["train/loss"] for r in records], rtol=1e-6)
  saved = json.loads((tmp_path / "config.json").read_text())
  assert saved["model"] == config.model.to_dict() and saved["steps"] == 4
  assert os.listdir(tmp_path / "checkpoints") == ["4"]


@pytest.mark.parametrize("mlp, heads", [((1, 30, 20, 13), "3,1,2,2"),
                                        ("0,22,21,21", (0, 3, 3, 2))])    # device 0 drained
def test_uneven_layout_without_slowdown_gives_the_even_losses(tmp_path, mlp, heads):
  even = train.train_and_evaluate(tiny_gpt(steps=5), str(tmp_path / "even"))
  uneven = train.train_and_evaluate(tiny_gpt(steps=5, mlp=mlp, heads=heads),
                                    str(tmp_path / "uneven"))
  np.testing.assert_allclose(uneven["losses"], even["losses"], rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(uneven["val/loss"], even["val/loss"], rtol=2e-6)
  assert even["losses"][-1] < even["losses"][0]


def test_accumulated_steps_give_the_losses_of_whole_batch_steps(tmp_path):
  # Two data replicas of an uneven tensor layout, each step in 4 microbatches of one row a
  # replica: the losses of steps over the whole batch at once, up to summation order.
  whole = train.train_and_evaluate(tiny_gpt(tensor=2, steps=5), str(tmp_path / "whole"))
  config = tiny_gpt(tensor=2, steps=5, mlp=(40, 24), heads=(3, 5))
  config.mesh.data, config.gradient_accumulation_steps = 2, 4
  accumulated = train.train_and_evaluate(config, str(tmp_path / "accumulated"))
  np.testing.assert_allclose(accumulated["losses"], whole["losses"], rtol=1e-5)
  np.testing.assert_allclose(accumulated["val/loss"], whole["val/loss"], rtol=1e-5)
  assert whole["losses"][-1] < whole["losses"][0]


def test_restore_onto_another_layout_and_device_count(tmp_path, monkeypatch):
  # Layout A on 4 tensor devices, interrupted after the step-3 checkpoint; continue with layout B
  # on 8 tensor devices, its blocks rematerialized (a policy is not part of a checkpoint).
  # Losses match the run that never changed layout.
  layout_a = dict(mlp=(10, 30, 4, 20), heads=(2, 3, 1, 2))
  layout_b = dict(mlp=(8, 8, 8, 1, 12, 9, 9, 9), heads=(1, 1, 1, 1, 1, 1, 1, 1))
  reference = train.train_and_evaluate(tiny_gpt(**layout_a), str(tmp_path / "ref"))
  workdir = str(tmp_path / "run")
  H.interrupted(monkeypatch, lambda: train.train_and_evaluate(tiny_gpt(**layout_a), workdir), 3)
  config = tiny_gpt(tensor=8, **layout_b)
  config.model.remat_policy = "full"
  moved = train.train_and_evaluate(config, workdir)
  assert moved["start_step"] == 3
  np.testing.assert_allclose(moved["losses"], reference["losses"][3:], rtol=2e-6, atol=2e-6)
  np.testing.assert_allclose(moved["val/loss"], reference["val/loss"], rtol=2e-6)


def test_every_way_out_closes_the_checkpoints_and_the_decision_log(tmp_path, monkeypatch):
  # An exception in the middle of a run (and, in bad_input_test, a NaN loss) leaves nothing
  # open: the Orbax manager and workdir/decisions.jsonl are closed on every path out.
  closed = H.record_closes(monkeypatch)
  config = tiny_gpt(steps=6)
  config.balance.policy = "semi"
  config.hetero.slowdown = (2.0, 1.0, 1.0, 1.0)
  H.interrupted(monkeypatch, lambda: train.train_and_evaluate(config, str(tmp_path)), 2)
  assert sorted(closed) == ["Checkpointer", "DecisionLog"]


@pytest.mark.parametrize("first, then", [("resize", "even"), ("even", "resize")])
def test_resume_under_another_policy_with_or_without_a_priority_snapshot(tmp_path, first, then):
  # A resizing run checkpoints its priority's weight snapshot; a policy that does not resize
  # has no use for it and resumes without it (it raised AttributeError), and a resizing policy
  # resumes from a checkpoint that has none.
  def config(policy, steps):
    c = tiny_gpt(steps=steps)
    c.balance.policy, c.hetero.slowdown, c.resize.refresh_every = policy, (1, 1, 1, 4), 1
    return c
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config(first, 3), workdir)
  assert os.path.isdir(os.path.join(workdir, "checkpoints", "3", "snapshot")) == (
      first == "resize")
  resumed = train.train_and_evaluate(config(then, 6), workdir)
  assert resumed["start_step"] == 3 and len(resumed["losses"]) == 3
  assert np.isfinite(resumed["losses"]).all() and np.isfinite(resumed["val/loss"])


@pytest.mark.parametrize("first, then", [("ssaw", "sync"), ("sync", "ssaw")])
def test_resume_in_another_sync_mode_is_refused_in_one_line(tmp_path, first, then):
  # Like a pipelined run's: the saved in-flight state (pending gradients) would be lost, or
  # would be missing; nothing is trained and the checkpoint stays.
  def config(mode, steps):
    c = tiny_gpt(tensor=4, steps=steps)
    c.mesh.data, c.sync.mode = 2, mode
    return c
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config(first, 3), workdir)
  with pytest.raises(ConfigError, match=(
      rf"^config.sync.mode: the checkpoint at step 3 in .* was saved by a '{first}' run, this "
      rf"one is '{then}' \(its in-flight state would be lost\); use another --workdir$")):
    train.train_and_evaluate(config(then, 6), workdir)
  assert os.listdir(os.path.join(workdir, "checkpoints")) == ["3"]
