"""Pipelined and planned runs through the training entry (`train.pipelined`,
`train.pipeline_setup`).

A pipelined run computes the same updates as an unpipelined one (its losses match step for
step), resumes exactly from its checkpoints, also on another number of stages and tensor
devices or unpipelined, and from an unpipelined run's checkpoint, checks its config before
compiling, and its emulated step is the planner's predicted step for the plan it runs.
`pipeline.layer_capacity` sets the layer slots every stage compiles and
`hetero.device_memory_gb` bounds the planner's memory.
"""

import json
import os
import shutil

import numpy as np
import pytest

import helpers as H
from semijax.errors import ConfigError
from semijax.planner import cluster as cluster_lib
from semijax.planner import predict as predict_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics
from semijax.train import pipeline_setup

SPEEDS = (1, 1, 1, 1, .5, .5, .5, .5)
REGIONS = (0, 0, 0, 0, 1, 1, 1, 1)


def set_field(c, key: str, value) -> None:
  """c["a.b.c"] = value."""
  *path, leaf = key.split(".")
  for part in path:
    c = c[part]
  c[leaf] = value


def tiny(steps=3, **fields):
  c = H.tiny_gpt(tensor=2, steps=steps)
  c.model.num_layers = 4
  c.checkpoint_every = 2
  for key, value in fields.items():
    set_field(c, key, value)
  return c


def with_links(c):
  c.hetero.device_speeds = SPEEDS
  c.hetero.links.regions = REGIONS
  c.hetero.links.latency_s = (1e-4, 1e-3)
  c.hetero.links.bandwidth = (1e9, 1e8)
  c.hetero.device_gflops = 50.0
  return c


def test_pipelined_run_matches_the_unpipelined_run(tmp_path):
  flat = train.train_and_evaluate(tiny(), str(tmp_path / "flat"))
  c = tiny(**{"mesh.data": 2, "mesh.pipe": 2, "pipeline.microbatches": "3,1",
              "pipeline.layers": "1,3", "pipeline.schedule": "gpipe",
              "layout.mlp": "40,24,0,64", "layout.heads": "5,3,0,8"})    # stage 1: one drained
  piped = train.train_and_evaluate(c, str(tmp_path / "piped"))
  np.testing.assert_allclose(piped["losses"], flat["losses"], rtol=2e-5)
  np.testing.assert_allclose(piped["val/loss"], flat["val/loss"], rtol=2e-5)
  plan = json.load(open(tmp_path / "piped" / "plan.json"))
  assert plan["stage_layers"] == [1, 3] and plan["microbatches"] == [3, 1]
  assert plan["stage_units"][1] == {"mlp": [0, 64], "heads": [0, 8]}


def test_resume_continues_exactly_on_as_many_stages_or_another_number(tmp_path):
  piped = {"mesh.pipe": 2, "optimizer.schedule_steps": 4}     # one schedule for every part
  # Logged every 3 steps and validated at the last only; of its checkpoints (2, 4) one is kept.
  whole = train.train_and_evaluate(
      tiny(steps=4, log_every=3, eval_every=4, keep_checkpoints=1, **piped),
      str(tmp_path / "whole"))
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "whole" / "metrics.jsonl"))] == [
      3, 4]
  assert os.listdir(tmp_path / "whole" / "checkpoints") == ["4"]
  workdir = str(tmp_path / "parts")
  train.train_and_evaluate(tiny(steps=2, **piped), workdir)
  for other in ("three", "unpiped"):
    shutil.copytree(workdir, tmp_path / other)
  resumed = train.train_and_evaluate(tiny(steps=4, **piped), workdir)
  assert resumed["start_step"] == 2
  np.testing.assert_allclose(resumed["losses"], whole["losses"][2:], rtol=1e-6)
  # Checkpoint 2 (4 layers, 2 stages of 2 tensor devices) onto 3 stages of 1 (logical rows 4
  # and 5 are padding).
  three = train.train_and_evaluate(tiny(steps=4, **dict(piped, **{
      "mesh.pipe": 3, "mesh.tensor": 1, "pipeline.layers": "1,2,1"})), str(tmp_path / "three"))
  assert three["start_step"] == 2
  np.testing.assert_allclose(three["losses"], whole["losses"][2:], rtol=2e-5)
  # ... and onto an unpipelined run on 4 tensor devices.
  unpiped = train.train_and_evaluate(tiny(steps=4, **{"optimizer.schedule_steps": 4,
                                                      "mesh.tensor": 4}),
                                     str(tmp_path / "unpiped"))
  assert unpiped["start_step"] == 2
  np.testing.assert_allclose(unpiped["losses"], whole["losses"][2:], rtol=2e-5)
  # An unpipelined run's checkpoint (4 tensor devices) resumes on 2 stages of 2, each block read
  # onto its stage's devices.
  flat = str(tmp_path / "flat")
  train.train_and_evaluate(tiny(steps=2, **{"optimizer.schedule_steps": 4, "mesh.tensor": 4}),
                           flat)
  from_flat = train.train_and_evaluate(tiny(steps=4, **piped), flat)
  assert from_flat["start_step"] == 2
  np.testing.assert_allclose(from_flat["losses"], whole["losses"][2:], rtol=2e-5)


@pytest.mark.parametrize("saved, pipe, said", [
    ({}, 2, "saved unpipelined with sync mode 'ssaw', this run is on 2 stages"),
    ({"pipe": 2}, None, "saved on 2 stages with sync mode 'ssaw', this run is unpipelined"),
    ({"pipe": 2}, 3, "saved on 2 stages with sync mode 'ssaw', this run is on 3 stages")])
def test_in_flight_replica_state_restores_onto_as_many_stages_only(saved, pipe, said):
  """A replica mode's checkpoint is refused on another stage count (in-flight state is kept per
  stage); a sync one, or one on as many stages, is not."""
  with pytest.raises(ConfigError, match=rf"^config.mesh.pipe: the checkpoint at step 3 in /w "
                     rf"was {said}; its in-flight state restores onto as many stages only"):
    checkpoint_lib.check_stages(saved, "ssaw", pipe, 3, "/w")
  checkpoint_lib.check_stages(saved, "sync", pipe, 3, "/w")
  checkpoint_lib.check_stages(saved, "ssaw", saved.get("pipe"), 3, "/w")


def test_a_scaled_run_resumes_its_scale_and_trains_like_the_unscaled_one(tmp_path):
  piped = {"mesh.pipe": 2, "optimizer.schedule_steps": 4, "log_every": 1}
  plain = train.train_and_evaluate(tiny(steps=4, **piped), str(tmp_path / "plain"))
  scaled = dict(piped, **{"optimizer.loss_scale": "dynamic", "optimizer.loss_scale_period": 1})
  workdir = str(tmp_path / "scaled")
  train.train_and_evaluate(tiny(steps=2, **scaled), workdir)
  resumed = train.train_and_evaluate(tiny(steps=4, **scaled), workdir)
  assert resumed["start_step"] == 2
  np.testing.assert_allclose(resumed["losses"], plain["losses"][2:], rtol=1e-6)
  assert [r["train/loss_scale"] for r in metrics.read_jsonl(f"{workdir}/metrics.jsonl")] == [
      2.0 ** 15, 2.0 ** 16, 2.0 ** 17, 2.0 ** 18]      # doubled after every finite step
  with pytest.raises(ConfigError, match=r"^config.optimizer.loss_scale: the checkpoint at step 4 "
                     r".* was saved with loss scaling 'dynamic', this run has 'none'"):
    train.train_and_evaluate(tiny(steps=6, **piped), workdir)


@pytest.mark.parametrize("key,value,field", [
    ("pipeline.layers", "1,2", "config.pipeline.layers"),
    ("pipeline.microbatches", "2,2,2", "config.pipeline.microbatches"),
    ("pipeline.schedule", "zigzag", "config.pipeline.schedule"),
    ("balance.policy", "migrate", "config.balance.policy"),
    ("hetero.slowdown", (1, 4), "config.hetero.slowdown"),
    ("hetero.device_speeds", (1, 1, 1), "config.hetero.device_speeds"),
    ("hetero.links.latency_s", (1, 2, 3), "config.hetero.links.latency_s"),
    ("layout.mlp", "60,4,1", "config.layout.mlp"),
    ("plan", "/no/such/plan.json", "config.plan"),
])
def test_bad_pipeline_config_is_named(key, value, field):
  c = tiny(**{"mesh.pipe": 2, "mesh.data": 2})
  if key.startswith("hetero.links"):
    c.hetero.links.regions = REGIONS
    c.hetero.device_speeds = SPEEDS
  set_field(c, key, value)
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
    config_lib.validate(c, 8)


def test_layer_capacity_sets_the_slots_every_stage_compiles():
  """Stages of 1 and 3 layers and of 2 and 2 both compile 3 slots per stage with capacity 3 (a
  boundary moved inside it compiles nothing); without it, each the most a stage holds."""
  def layout(layers, capacity):
    run = config_lib.validate(tiny(**{"mesh.pipe": 2, "pipeline.layers": layers,
                                      "pipeline.layer_capacity": capacity}), 8)
    return pipeline_setup.build(run, pipeline_setup.resolve_plan(run, 8)).layout

  moved = [layout("1,3", 3), layout("2,2", 3)]
  assert [x.stage_layers for x in moved] == [(1, 3), (2, 2)]
  assert [x.layers.capacity for x in moved] == [3, 3]
  assert moved[0].bucket() == moved[1].bucket()
  assert layout("2,2", 0).layers.capacity == 2 and layout("1,3", 0).layers.capacity == 3
  with pytest.raises(ConfigError, match=r"^config\.pipeline\.layer_capacity: 2 slots, but a "
                     r"stage holds 3 layers"):
    layout("1,3", 2)


def test_microbatch_capacity_sets_the_microbatches_every_pipeline_compiles():
  """Two pipelines of 4 microbatches compile 4 each; a `semi` run room to re-split the batch
  (`capacity_factor` 2 x 4, at most 8 less one for the other pipeline: 7); a capacity set is
  kept, one below what a pipeline runs refused, and so is one in a replica sync mode."""
  def slots(policy, capacity=0):
    c = tiny(**{"mesh.pipe": 2, "mesh.data": 2, "pipeline.microbatches": 4,
                "pipeline.microbatch_capacity": capacity, "balance.policy": policy})
    c.hetero.device_speeds = (1.0,) * 8
    run = config_lib.validate(c, 8)
    return pipeline_setup.microbatch_slots(run, pipeline_setup.resolve_plan(run, 8))

  assert slots("even") == 4 and slots("semi") == 7 and slots("even", 5) == 5
  with pytest.raises(ConfigError, match=r"^config\.pipeline\.microbatch_capacity: 3, but a "
                     r"pipeline of the plan runs 4"):
    slots("semi", 3)
  c = tiny(**{"mesh.pipe": 2, "mesh.data": 2, "pipeline.microbatches": 4,
              "pipeline.microbatch_capacity": 5, "sync.mode": "ssaw"})
  run = config_lib.validate(c, 8)
  with pytest.raises(ConfigError, match=r"^config\.pipeline\.microbatch_capacity: sync mode"):
    pipeline_setup.microbatch_slots(run, pipeline_setup.resolve_plan(run, 8))


def test_device_memory_bounds_the_planner():
  """A bound just below the fastest plan's need makes the planner choose a plan that fits it
  (no faster: another plan may be as fast with less memory); a bound nothing fits is refused.
  The bound counts 1e9 bytes per GB."""
  c = with_links(tiny(steps=2, plan="auto"))
  free = pipeline_setup.resolve_plan(config_lib.validate(c, 8), 8)
  bound = 0.999 * max(free.breakdown["memory_bytes"])
  c.hetero.device_memory_gb = bound / 1e9
  bounded = pipeline_setup.resolve_plan(config_lib.validate(c, 8), 8)
  assert max(bounded.breakdown["memory_bytes"]) <= bound
  assert bounded.breakdown["memory_use"] == pytest.approx(
      max(bounded.breakdown["memory_bytes"]) / bound)
  assert bounded.predicted_s >= free.predicted_s
  c.hetero.device_memory_gb = 1e-7
  with pytest.raises(ConfigError, match=r"^cluster\.memory: no plan fits"):
    pipeline_setup.resolve_plan(config_lib.validate(c, 8), 8)


def test_planned_run_emulates_the_predicted_step(tmp_path):
  c = with_links(tiny(steps=2, plan="auto"))
  run = config_lib.validate(c, 8)
  plan = pipeline_setup.resolve_plan(run, 8)
  setup = pipeline_setup.build(run, plan)
  emulated = pipeline_setup.emulated_step(setup)
  np.testing.assert_allclose(emulated["step_s"], plan.predicted_s, rtol=1e-9)
  # Also with padding: uneven layers and units, so devices hold more slots than they own (the
  # all-reduces carry them).
  uneven = with_links(tiny(**{"mesh.data": 2, "mesh.pipe": 2, "pipeline.layers": "1,3",
                              "pipeline.microbatches": "3,1", "layout.mlp": "40,24,10,54"}))
  run_uneven = config_lib.validate(uneven, 8)
  plan_uneven = pipeline_setup.resolve_plan(run_uneven, 8)
  emulated = pipeline_setup.emulated_step(pipeline_setup.build(run_uneven, plan_uneven))
  np.testing.assert_allclose(emulated["step_s"], plan_uneven.predicted_s, rtol=1e-9)
  assert emulated["allreduce_s"] > 0 and emulated["transfer_s"] > 0
  # A plan spanning both regions over the slower link costs more than with free links.
  free = cluster_lib.Cluster(np.asarray(SPEEDS, float), np.inf, np.zeros((8, 8)),
                             np.full((8, 8), np.inf))
  assert predict_lib.predict(plan, pipeline_setup.model_costs(run), free)["step_s"] < plan.predicted_s
  summary = train.train_and_evaluate(c, str(tmp_path / "auto"))
  assert summary["plan"] == json.load(open(tmp_path / "auto" / "plan.json"))
  assert min(summary["step_times_s"]) >= plan.predicted_s
