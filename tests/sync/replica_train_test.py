"""train_and_evaluate with config.sync on emulated replicas (one process, 8 fake devices).

Equal replicas: ssaw and async take exactly sync's steps (bit-identical losses), also on an
uneven tensor layout with a slow tensor device, and record the steps log_every says. Slow
replicas: every sample of the budget is applied exactly once, the fast take more of it, no
gradient is staler than the bound. A run resumed from a checkpoint (which holds the in-flight
gradients, or local SGD's replicas) continues exactly.
"""

import numpy as np
import pytest

import helpers as H
from helpers import tiny_gpt
from semijax.sync import rounds as rounds_lib
from semijax.train import config as config_lib
from semijax.train import data as data_lib
from semijax.train import loop as train
from semijax.train import metrics
from semijax.train import replica_modes

ENGINES: dict = {}       # compiled steps shared by the runs of this module


def config(mode="sync", slowdown=None, steps=4, tensor=2, data=4, **kw):
  c = tiny_gpt(tensor=tensor, steps=steps)
  c.mesh.data = data
  c.sync.mode = mode
  c.checkpoint_every = 0
  if slowdown is not None:
    c.hetero.replica_slowdown = slowdown
  for key, value in kw.items():
    node, _, field = key.rpartition(".")
    (c[node] if node else c)[field] = value
  return c


def run(c, workdir):
  return train.train_and_evaluate(c, str(workdir), engine_cache=ENGINES)


@pytest.mark.parametrize("layout", [{}, {"layout.mlp": (40, 24), "layout.heads": (5, 3),
                                         "hetero.slowdown": (1.0, 2.0)}])
def test_equal_replicas_train_exactly_like_sync(tmp_path, layout):
  # Logged every 3 steps, validated at the end only: metrics.jsonl holds steps 3 and 4.
  c = lambda mode: config(mode, log_every=3, eval_every=4, **layout)
  H.check_equal_replicas_train_like_sync(run, c, tmp_path, steps=4, batch_size=8)
  for mode in ("sync", "ssaw", "async"):
    records = metrics.read_jsonl(str(tmp_path / mode / "metrics.jsonl"))
    assert [r["step"] for r in records] == [3, 4], mode


@pytest.mark.parametrize("mode", ["ssaw", "local_sgd"])
def test_replicas_accumulating_microbatches_train_like_whole_batches(tmp_path, mode):
  # Each of 4 replicas runs its 2 rows as 2 microbatches: its own mean gradient, up to
  # summation order, so the run's losses are those of one pass.
  whole = run(config(mode, steps=3), tmp_path / "whole")
  accumulated = run(config(mode, steps=3, gradient_accumulation_steps=2), tmp_path / "acc")
  np.testing.assert_allclose(accumulated["losses"], whole["losses"], rtol=1e-5)
  np.testing.assert_allclose(accumulated["val/loss"], whole["val/loss"], rtol=1e-5)


def test_slow_replicas_use_every_sample_once_and_the_fast_take_more(tmp_path):
  c = config("ssaw", (1.0, 1.0, 2.0, 4.0), steps=5, **{"sync.staleness_bound": 2})
  owned = H.check_every_microbatch_once(run(c, tmp_path), tmp_path, steps=5, replicas=4,
                                        batch_size=8, bound=2)
  assert len(owned[0]) > len(owned[2]) > len(owned[3])


def test_every_image_of_the_budget_once(tmp_path):
  # ViT digits: the samples are positions in the epoch's order; the applied microbatches cover
  # the first steps x batch_size of them, each exactly once.
  c = H.load("vit_digits")
  c.model.update(dict(d_model=32, num_heads=4, d_ff=32, num_layers=1))
  c.mesh.data, c.mesh.tensor = 4, 2
  c.batch_size, c.steps, c.eval_every, c.checkpoint_every = 16, 6, 3, 0
  c.sync.mode, c.hetero.replica_slowdown = "async", (1.0, 3.0, 1.0, 1.0)
  out = train.train_and_evaluate(c, str(tmp_path))
  run_config = config_lib.validate(c)
  dataset = data_lib.build(run_config.data)
  batches = replica_modes.Batches(dataset, 4)
  rows = 16 // 4
  used = []
  for r, mbs in enumerate(out["sync"]["microbatches"]):
    for j in mbs:
      positions = dataset.train_positions(j // 4)[(j % 4) * rows:(j % 4 + 1) * rows]
      np.testing.assert_array_equal(dataset.images[dataset.train_index[positions]],
                                    batches.microbatch(j)["images"])
      used.extend(positions.tolist())
  assert sorted(used) == sorted(dataset.epoch_order(0)[:6 * 16].tolist())
  assert len(set(used)) == 6 * 16
  assert len(out["sync"]["microbatches"][1]) < len(out["sync"]["microbatches"][0])


@pytest.mark.parametrize("mode, extra, cls, name", [
    ("ssaw", {}, rounds_lib.RoundRunner, "round"),
    ("local_sgd", {"sync.local_steps": 2, "sync.outer": "nesterov"}, replica_modes.LocalSGD,
     "update")])
def test_resume_continues_exactly(tmp_path, monkeypatch, mode, extra, cls, name):
  c = lambda: config(mode, (1.0, 2.0, 1.0, 3.0), steps=5, checkpoint_every=3, **extra)
  H.check_replica_resume(run, c, tmp_path, monkeypatch, cls, name)


@pytest.mark.parametrize("mode, extra, cls, name", [
    ("ssaw", {}, rounds_lib.RoundRunner, "round"),
    ("local_sgd", {"sync.local_steps": 2, "gradient_accumulation_steps": 2},
     replica_modes.LocalSGD, "update")])
def test_a_scaled_run_trains_like_the_unscaled_one_and_resumes_its_scale(
    tmp_path, monkeypatch, mode, extra, cls, name):
  c = lambda: config(mode, (1.0, 2.0, 1.0, 3.0), steps=5, checkpoint_every=3, **extra)
  H.check_scaled_replica_run(run, c, tmp_path, monkeypatch, cls, name)


@pytest.mark.parametrize("mode, expected", [("sync", (3.0, 6.0)), ("ssaw", (1.0, 2.0))])
def test_a_sync_step_waits_for_the_slowest_replica(mode, expected):
  c = config(mode, (1.0, 3.0, 1.0, 1.0), **{"hetero.slowdown": (1.0, 2.0)})
  emulator = train.build_emulator(config_lib.validate(c))
  assert emulator.hetero.slowdown == expected
