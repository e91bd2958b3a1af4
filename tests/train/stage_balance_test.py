"""A pipelined run that re-plans online (`balance.policy = "semi"`, `train.stage_balance`).

With stage 0 slow and one of its devices slower still, emulated or seen by the probe, the run
moves layers to stage 1 and the slower device's units to its neighbour while it trains, without
compiling, and computes the same losses as the run that keeps the even layout; its checkpoint
keeps the moved layout, and a run resumed from it continues there with the uninterrupted run's
losses. Of two data-parallel pipelines, a slow one gets fewer microbatches, with the same
losses, and a run resumed after the re-split keeps it. The config refuses what it cannot re-plan, naming the field.
"""

import shutil

import numpy as np
import pytest

import helpers as H
from semijax.balance import probe as probe_lib
from semijax.errors import ConfigError
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics

SPEEDS = (0.5, 0.125, 1, 1)     # stage 0 is slow, its second tensor device 4x slower still


def config(policy: str, steps: int = 12):
  c = H.tiny_gpt(tensor=2, steps=steps)
  c.model.num_layers = 8
  c.mesh.pipe = 2
  c.pipeline.microbatches = 4
  c.pipeline.layer_capacity = 5           # stage 0 keeps 3 layers at least: its units matter
  c.hetero.device_speeds = SPEEDS
  c.hetero.device_gflops = 0.5            # emulated steps of about 0.2-0.5 s
  c.balance.policy = policy
  c.balance.probe_every = 2
  c.balance.num_widths = 4                # widths a proportional split can run faster at
  c.balance.min_dwell_steps = 2
  c.checkpoint_every = 6
  c.keep_checkpoints = 2
  c.optimizer.schedule_steps = 12
  return c


def test_semi_moves_layers_and_units_off_the_slow_device(tmp_path):
  even = train.train_and_evaluate(config("even"), str(tmp_path / "even"))
  semi = train.train_and_evaluate(config("semi"), str(tmp_path / "semi"))
  assert semi["replans"] >= 1 and semi["replan_compiles"] == 0    # warm-up compiled them
  layout = semi["layout"]
  layers = [len(owned) for owned in layout["layers"]]
  assert layers == [3, 5]
  mlp = layout["units"][0]["mlp"]
  assert len(mlp["owned"][1]) < len(mlp["owned"][0])
  np.testing.assert_allclose(semi["losses"], even["losses"], rtol=2e-5)
  # Every step's emulated time is that of the layout it ran in: less once moved.
  records = metrics.read_jsonl(str(tmp_path / "semi" / "metrics.jsonl"))
  emulated = [r["pipeline/emulated_s"] for r in records]
  assert emulated[-1] < 0.8 * emulated[0]
  # Resumed from the checkpoint after the move: in the moved layout, the same losses.
  resumed_dir = tmp_path / "resumed"
  shutil.copytree(tmp_path / "semi", resumed_dir)
  shutil.rmtree(resumed_dir / "checkpoints" / "12")
  resumed = train.train_and_evaluate(config("semi"), str(resumed_dir))
  assert resumed["start_step"] == 6
  assert resumed["layout"] == layout and resumed["replans"] == 0
  np.testing.assert_allclose(resumed["losses"], semi["losses"][6:], rtol=2e-5)


def slow_probe(monkeypatch, factors: dict) -> None:
  """Makes the probe read each device id of `factors` that many times slower."""
  measure = probe_lib.Probe.measure

  def measured(self):
    return {d: s * factors.get(d, 1.0) for d, s in measure(self).items()}

  monkeypatch.setattr(probe_lib.Probe, "measure", measured)


def test_semi_sees_a_slow_device_through_the_probe(tmp_path, monkeypatch):
  slow_probe(monkeypatch, {0: 2.0, 1: 8.0})                  # as SPEEDS
  c = config("semi")
  c.hetero.device_speeds = ()
  c.balance.probe_window = 1
  probed = train.train_and_evaluate(c, str(tmp_path / "probed"))
  assert probed["replans"] >= 1
  layers = [len(owned) for owned in probed["layout"]["layers"]]
  mlp = probed["layout"]["units"][0]["mlp"]
  assert layers == [3, 5] and len(mlp["owned"][1]) < len(mlp["owned"][0])
  c = config("even")
  c.hetero.device_speeds = ()
  even = train.train_and_evaluate(c, str(tmp_path / "even"))
  np.testing.assert_allclose(probed["losses"], even["losses"], rtol=2e-5)


def test_semi_gives_a_slow_pipeline_fewer_microbatches(tmp_path):
  # Two pipelines of 2 stages x 2 tensor devices; pipeline 1's four devices run at half speed,
  # so neither layers nor units can help: the batch is re-split between the pipelines.
  def two_pipelines(policy):
    c = config(policy, steps=8)
    c.mesh.data = 2
    c.hetero.device_speeds = (1, 1, 1, 1, 0.5, 0.5, 0.5, 0.5)
    c.checkpoint_every = 4
    return c

  even = train.train_and_evaluate(two_pipelines("even"), str(tmp_path / "even"))
  semi = train.train_and_evaluate(two_pipelines("semi"), str(tmp_path / "semi"))
  split = semi["microbatches"]
  assert semi["replans"] >= 1 and split[1] < split[0] and sum(split) == 8
  np.testing.assert_allclose(semi["losses"], even["losses"], rtol=2e-5)
  np.testing.assert_allclose(semi["val/loss"], even["val/loss"], rtol=2e-5)
  emulated = [r["pipeline/emulated_s"]
              for r in metrics.read_jsonl(str(tmp_path / "semi" / "metrics.jsonl"))]
  assert emulated[-1] < 0.9 * emulated[0]
  # Resumed from the checkpoint after the re-split: in the saved split, the same losses.
  shutil.copytree(tmp_path / "semi", tmp_path / "resumed")
  shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "8")
  resumed = train.train_and_evaluate(two_pipelines("semi"), str(tmp_path / "resumed"))
  assert resumed["start_step"] == 4 and resumed["replans"] == 0
  assert resumed["microbatches"] == split
  np.testing.assert_allclose(resumed["losses"], semi["losses"][4:], rtol=2e-5)


@pytest.mark.parametrize("fields, field", [
    ({"hetero.device_speeds": (), "balance.measure": "emulated"}, "config.balance.measure"),
    ({"hetero.device_speeds": (), "balance.measure": "sched"}, "config.balance.measure"),
    ({"balance.measure": "probe"}, "config.balance.measure"),
    ({"sync.mode": "ssaw", "mesh.data": 2, "hetero.device_speeds": SPEEDS * 2},
     "config.sync.mode"),
    ({"balance.policy": "migrate"}, "config.balance.policy"),
    ({"balance.policy": "even", "hetero.device_speeds": (), "hetero.rotate_every": 4},
     "config.hetero.rotate_every"),
])
def test_what_cannot_re_plan_is_named(fields, field):
  c = config("semi")
  for key, value in fields.items():
    *path, leaf = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[leaf] = value
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    config_lib.validate(c, 8)
