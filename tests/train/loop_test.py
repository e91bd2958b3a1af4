"""The training loop's shared behaviour, through each kind of run (`KINDS`): a run killed
mid-step, or stopped by SIGTERM, resumes to the losses of one never interrupted, with every step
in metrics.jsonl once;
a non-finite loss stops the run and keeps the last good checkpoint; the hooks see every step
once, with the scalars recorded."""

import dataclasses
import math
import os
import signal
from typing import Callable

import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from semijax.core import engine as engine_lib
from semijax.core import pipeline
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics
from semijax.train import pipeline_setup
from semijax.train import pipelined
from semijax.train import replica_modes
from semijax.train import tensor

def pipelined_gpt(steps, data=1):
  """tiny_gpt on `data` pipelines of 2 stages of 2 tensor devices, uneven layers (and, with
  one pipeline, uneven units), 2 microbatches per pipeline."""
  c = H.tiny_gpt(tensor=2, steps=steps)
  c.model.num_layers = 3
  c.mesh.data, c.mesh.pipe = data, 2
  c.pipeline.layers, c.pipeline.microbatches = "1,2", "2"
  if data == 1:
    c.layout.mlp, c.layout.heads = "40,24,10,54", "5,3,2,6"
  return c


def replicas_gpt(steps, mode, pipelined=False):
  """Two replicas in `mode` (equal speeds): tensor-parallel groups of 4, or pipelines."""
  c = pipelined_gpt(steps, data=2) if pipelined else H.tiny_gpt(tensor=4, steps=steps)
  c.mesh.data = 2
  c.sync.mode, c.sync.local_steps = mode, 2
  return c


def pipelined_abstract(run):
  return pipeline_setup.build(run, pipeline_setup.resolve_plan(run, 8)).engine.abstract_logical()


def tensor_abstract(run):
  return tensor.build_engine(run).abstract_logical()


def poison_metrics(out):
  state, m = out
  return state, dict(m, loss=jnp.float32(jnp.nan))


def poison_update(out):
  state, update = out
  update.loss = float("nan")
  return state, update


@dataclasses.dataclass(frozen=True)
class Kind:
  """A kind of run: `config()` trains 6 steps (updates), checkpointed every 3 and logged every
  step; `cls.method` runs once per step and `poison` makes its result report a NaN loss;
  `abstract(run)` is the logical state its checkpoints hold."""

  config: Callable
  cls: type
  method: str
  poison: Callable
  abstract: Callable


KINDS = {
    "tensor": Kind(lambda: H.tiny_gpt(steps=6, mlp=(10, 30, 4, 20)), engine_lib.Engine,
                   "train_step", poison_metrics, tensor_abstract),
    "pipelined": Kind(lambda: pipelined_gpt(steps=6), pipeline.PipelineEngine, "train_step",
                      poison_metrics, pipelined_abstract),
    "ssaw replicas": Kind(lambda: replicas_gpt(6, "ssaw"), replica_modes.Rounds, "update",
                          poison_update, tensor_abstract),
    "local_sgd pipelines": Kind(lambda: replicas_gpt(6, "local_sgd", pipelined=True),
                                replica_modes.LocalSGD, "update", poison_update,
                                pipelined_abstract),
}


def records(workdir):
  return metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))


def nan_at(monkeypatch, kind: Kind, call):
  """Makes `kind`'s step report a NaN loss on its call number `call` (1-based)."""
  original, count = getattr(kind.cls, kind.method), {"n": 0}

  def patched(self, *a, **kw):
    count["n"] += 1
    out = original(self, *a, **kw)
    return kind.poison(out) if count["n"] == call else out
  monkeypatch.setattr(kind.cls, kind.method, patched)


REFERENCES: dict = {}


def uninterrupted(kind: str, tmp_path_factory) -> dict:
  """The summary of `kind`'s run never interrupted (run once per kind in a worker), after
  checking that its hooks and its metrics saw every step once, with the losses it returns."""
  if kind not in REFERENCES:
    seen, workdir = [], str(tmp_path_factory.mktemp("reference"))
    reference = train.train_and_evaluate(KINDS[kind].config(), workdir,
                                         hooks=[lambda step, s: seen.append((step, s))])
    assert [step for step, _ in seen] == [1, 2, 3, 4, 5, 6]
    assert [s["train/loss"] for _, s in seen] == reference["losses"]
    assert [r["train/loss"] for r in records(workdir)] == reference["losses"]
    REFERENCES[kind] = reference
  return REFERENCES[kind]


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_resume_after_a_kill_continues_exactly_with_every_step_once(tmp_path, tmp_path_factory,
                                                                    monkeypatch, kind):
  config = KINDS[kind].config
  reference = uninterrupted(kind, tmp_path_factory)
  workdir = str(tmp_path / "run")
  H.interrupted(monkeypatch, lambda: train.train_and_evaluate(config(), workdir), 4,
                KINDS[kind].cls, KINDS[kind].method)    # checkpoint at 3, killed during step 5
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints"))) == ["3"]
  resumed = train.train_and_evaluate(config(), workdir)
  assert resumed["start_step"] == 3
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4, 5, 6]    # step 4 not doubled
  np.testing.assert_allclose(resumed["losses"], reference["losses"][3:], rtol=1e-6)
  np.testing.assert_allclose([r["train/loss"] for r in records(workdir)],
                             reference["losses"], rtol=1e-6)
  np.testing.assert_allclose(resumed["val/loss"], reference["val/loss"], rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch,
                                                                     kind):
  config = KINDS[kind].config
  workdir = str(tmp_path)
  nan_at(monkeypatch, KINDS[kind], 5)
  closed = H.record_closes(monkeypatch)
  with pytest.raises(FloatingPointError, match=r"^train/loss is nan at step 5: training "
                     r"stopped. The last good checkpoint \(step 3\)"):
    train.train_and_evaluate(config(), workdir)
  assert closed.count("Checkpointer") == 1       # closed on the way out
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4, 5]
  assert math.isnan(records(workdir)[-1]["train/loss"])
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  try:
    assert ckpt.all_steps() == [3]
    run = config_lib.validate(config())
    state, meta = ckpt.restore(KINDS[kind].abstract(run))
  finally:
    ckpt.close()
  assert meta["data_position"] == 3
  assert all(np.isfinite(np.asarray(x)).all() for x in H.jax.tree.leaves(state.params))


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_sigterm_saves_at_the_next_step_and_the_rerun_continues_exactly(tmp_path,
                                                                        tmp_path_factory, kind):
  config = KINDS[kind].config
  reference = uninterrupted(kind, tmp_path_factory)
  workdir = str(tmp_path / "run")

  def terminate_after_3(step, scalars):
    if step == 3:
      os.kill(os.getpid(), signal.SIGTERM)     # the handler notes it; the run goes on to step 4

  stopped = train.train_and_evaluate(config(), workdir, hooks=[terminate_after_3])
  assert stopped["preempted"] == 4 and stopped["steps"] == 4
  assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL      # the handler was put back
  assert sorted(os.listdir(os.path.join(workdir, "checkpoints")), key=int) == ["3", "4"]
  np.testing.assert_allclose(stopped["losses"], reference["losses"][:4], rtol=1e-6)
  resumed = train.train_and_evaluate(config(), workdir)
  assert resumed["start_step"] == 4 and "preempted" not in resumed
  assert [r["step"] for r in records(workdir)] == [1, 2, 3, 4, 5, 6]
  np.testing.assert_allclose([r["train/loss"] for r in records(workdir)],
                             reference["losses"], rtol=1e-6)
  np.testing.assert_allclose(resumed["val/loss"], reference["val/loss"], rtol=1e-6)


def ahead_steps(monkeypatch, executor=tensor.TensorParallel) -> list:
  """Records, for each step of `executor`, whether it let the step run ahead."""
  original, ahead = executor.step, []

  def recording(self, step):
    result = original(self, step)
    ahead.append(result.seconds is None)
    return result
  monkeypatch.setattr(executor, "step", recording)
  return ahead


@pytest.mark.parametrize("kind,executor", [("tensor", tensor.TensorParallel),
                                           ("pipelined", pipelined.Pipelined)])
def test_steps_between_records_run_ahead_to_the_same_losses(kind, executor, tmp_path,
                                                            tmp_path_factory, monkeypatch):
  reference = uninterrupted(kind, tmp_path_factory)              # logs and evaluates each step
  c = KINDS[kind].config()
  c.log_every, c.eval_every, c.checkpoint_every = 4, 6, 0
  ahead = ahead_steps(monkeypatch, executor)
  summary = train.train_and_evaluate(c, str(tmp_path))
  # A fixed layout or plan, no emulation: nothing makes the executor wait; the loop waits at
  # step 4 (a record) and 6 (the last), each for the steps since its previous wait.
  assert ahead == [True] * 6
  assert summary["losses"] == reference["losses"]                # bit for bit, in order
  assert summary["val/loss"] == reference["val/loss"]
  assert len(summary["step_times_s"]) == 6 and all(t > 0 for t in summary["step_times_s"])
  assert [r["step"] for r in records(str(tmp_path))] == [4, 6]
  assert [r["train/loss"] for r in records(str(tmp_path))] == [reference["losses"][i]
                                                              for i in (3, 5)]


def test_a_nan_in_a_step_that_ran_ahead_stops_at_its_step_before_the_checkpoint(tmp_path,
                                                                               monkeypatch):
  c = KINDS["tensor"].config()
  c.log_every, c.eval_every, c.checkpoint_every = 6, 6, 3    # waits at the checkpoints (3, 6)
  nan_at(monkeypatch, KINDS["tensor"], 5)
  with pytest.raises(FloatingPointError, match=r"^train/loss is nan at step 5: training "
                     r"stopped. The last good checkpoint \(step 3\)"):
    train.train_and_evaluate(c, str(tmp_path))
  ckpt = checkpoint_lib.Checkpointer(os.path.join(str(tmp_path), "checkpoints"))
  try:
    assert ckpt.all_steps() == [3]            # step 6 was never saved
  finally:
    ckpt.close()
  assert [r["step"] for r in records(str(tmp_path))] == [5]       # the NaN, nothing logged before
  assert math.isnan(records(str(tmp_path))[-1]["train/loss"])


def test_semi_waits_only_for_the_steps_it_samples(tmp_path, monkeypatch):
  c = KINDS["tensor"].config()
  c.steps, c.log_every, c.eval_every, c.checkpoint_every = 8, 8, 8, 0
  c.balance.policy, c.balance.measure, c.balance.probe_every = "semi", "probe", 3
  ahead = ahead_steps(monkeypatch)
  summary = train.train_and_evaluate(c, str(tmp_path))
  assert ahead == [s % 3 != 0 for s in range(8)]      # samples after 0-based steps 0, 3, 6
  assert summary["balance"]["probes"] == 3
