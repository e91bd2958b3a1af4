"""ssaw, async and local_sgd with data-parallel pipelines (`config.sync` on a pipelined run).

Each pipeline is a replica: `PipelineEngine.replica_grads_and_terms` gives its own gradient and
`semijax.sync`'s programs and round rule combine them, as for tensor-parallel replicas. Equal
pipelines take exactly the synchronous pipelined steps (bit-identical losses); with one pipeline
on half-speed devices every microbatch of the budget is applied once, the fast pipeline computes
more of them and no gradient is staler than the bound; a run resumed from a checkpoint (holding
the pending gradients or local SGD's replicas, converted through the pipeline's logical form)
continues exactly; the planner can choose the mode, and the run follows its plan.
"""

import json
import os

import pytest

import helpers as H
from semijax.errors import ConfigError
from semijax.sync import rounds as rounds_lib
from semijax.train import loop as train
from semijax.train import replica_modes

SLOW_HALF = (1, 1, 1, 1, .5, .5, .5, .5)     # pipeline 1 (devices 4-7) at half speed


def config(mode="sync", steps=4, **fields):
  c = H.tiny_gpt(tensor=2, steps=steps)
  c.model.num_layers = 4
  c.mesh.data, c.mesh.pipe = 2, 2
  c.pipeline.microbatches = 2
  c.checkpoint_every = 0
  c.sync.mode = mode
  for key, value in fields.items():
    *path, field = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[field] = value
  return c


def slow(c):
  c.hetero.device_speeds = SLOW_HALF
  c.hetero.device_gflops = 200.0
  return c


def train_in(c, workdir):
  return train.train_and_evaluate(c, str(workdir))


def test_equal_pipelines_train_exactly_like_sync(tmp_path):
  H.check_equal_replicas_train_like_sync(train_in, config, tmp_path, steps=4, batch_size=8)


def test_a_slow_pipeline_uses_every_sample_once_and_the_fast_takes_more(tmp_path):
  out = train_in(slow(config("ssaw", steps=6, **{"sync.staleness_bound": 2})), tmp_path)
  owned = H.check_every_microbatch_once(out, tmp_path, steps=6, replicas=2, batch_size=8,
                                        bound=2)
  assert len(owned[0]) > len(owned[1])


@pytest.mark.parametrize("mode, extra, cls, name", [
    ("ssaw", {}, rounds_lib.RoundRunner, "round"),
    ("local_sgd", {"sync.local_steps": 2}, replica_modes.LocalSGD, "update")])
def test_resume_continues_exactly(tmp_path, monkeypatch, mode, extra, cls, name):
  c = lambda: slow(config(mode, steps=5, checkpoint_every=3, **extra))
  workdir = H.check_replica_resume(train_in, c, tmp_path, monkeypatch, cls, name)
  # Done once its samples are, though its checkpoints count more updates than steps.
  assert train_in(c(), workdir).get("already_trained")
  with pytest.raises(ConfigError, match=rf"config.sync.mode: the checkpoint .* by a '{mode}' run"):
    train_in(slow(config("sync", steps=6)), workdir)
  with pytest.raises(ConfigError, match=rf"config.mesh.pipe: .* saved on 2 stages with sync "
                     rf"mode '{mode}', this run is on 4 stages; its in-flight state"):
    train_in(slow(config(mode, steps=6, **{"mesh.pipe": 4, "mesh.tensor": 1}, **extra)),
             workdir)
  with pytest.raises(ConfigError, match=rf"config.mesh.pipe: .* saved on 2 stages with sync "
                     rf"mode '{mode}', this run is unpipelined; its in-flight state"):
    train_in(slow(config(mode, steps=6, **{"mesh.pipe": 1, "mesh.tensor": 4}, **extra)),
             workdir)


def test_a_scaled_ssaw_run_trains_like_the_unscaled_one_and_resumes_its_scale(tmp_path,
                                                                             monkeypatch):
  c = lambda: slow(config("ssaw", steps=5, checkpoint_every=3))
  H.check_scaled_replica_run(train_in, c, tmp_path, monkeypatch, rounds_lib.RoundRunner,
                             "round")


def test_the_planner_chooses_the_mode_and_the_run_follows_it(tmp_path):
  c = slow(config(steps=2, plan="auto", **{"planner.syncs": "ssaw"}))
  out = train.train_and_evaluate(c, str(tmp_path))
  plan = json.load(open(os.path.join(tmp_path, "plan.json")))
  assert plan["sync"] == "ssaw" and len(set(plan["microbatches"])) == 1
  assert out["sync"]["mode"] == "ssaw" and out["sync"]["samples"] == 2 * 8


@pytest.mark.parametrize("fields, field", [
    ({"pipeline.microbatches": "3,1"}, "config.pipeline.microbatches"),
    ({"planner.syncs": "sync,gossip"}, "config.planner.syncs"),
])
def test_bad_replica_mode_config_is_named(tmp_path, fields, field):
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    train.train_and_evaluate(config("ssaw", **fields), str(tmp_path))
  assert not os.path.exists(os.path.join(tmp_path, "checkpoints"))
