"""Damaged checkpoints are never loaded: a checkpoint whose files do not match the checksums
recorded when it was saved (a truncated or missing array file, flipped bytes, garbled metadata,
a save cut short) is named in one line and skipped, the run resumes from the newest intact one
and continues as if never interrupted, and nothing is deleted; with none intact, one clear
error. The NaN stop names the newest checkpoint that verifies."""

import math
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from semijax.core import engine as engine_lib
from semijax.errors import ConfigError
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import loop as train
from semijax.train import metrics


ENGINES: dict = {}       # the runs of this module share compiled engines


def run(workdir, steps=6):
  c = H.tiny_gpt(steps=steps)    # checkpoints every 3 steps, the last two kept
  return train.train_and_evaluate(c, str(workdir), engine_cache=ENGINES)


flip = H.flip_bytes
DAMAGE = H.CHECKPOINT_DAMAGE


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_is_set_aside_and_the_run_resumes_from_the_intact_one(
    tmp_path, capsys, damage):
  reference = run(tmp_path)                      # leaves checkpoints 3 and 6
  ckpt = checkpoint_lib.Checkpointer(os.path.join(tmp_path, "checkpoints"))
  try:
    assert ckpt.all_steps() == [3, 6] and ckpt.verify(6) is None and ckpt.verify(3) is None
    apply, said = DAMAGE[damage]
    apply(ckpt.folder(6))
    assert re.search(said, ckpt.verify(6))
  finally:
    ckpt.close()
  capsys.readouterr()
  resumed = run(tmp_path)
  lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("checkpoint step 6")]
  assert len(lines) == 1 and "is damaged" in lines[0] and re.search(said, lines[0]), lines
  assert resumed["start_step"] == 3
  np.testing.assert_allclose(resumed["losses"], reference["losses"][3:], rtol=1e-6)
  np.testing.assert_allclose(resumed["val/loss"], reference["val/loss"], rtol=1e-6)
  records = metrics.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))
  assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
  assert os.listdir(tmp_path / "checkpoints.damaged") == ["6"]       # kept, out of the way
  assert sorted(os.listdir(tmp_path / "checkpoints")) == ["3", "6"]


def test_no_intact_checkpoint_is_one_clear_error_and_moves_nothing(tmp_path):
  run(tmp_path)
  for step in (3, 6):
    flip(os.path.join(tmp_path, "checkpoints", str(step)))
  before = sorted(os.listdir(tmp_path / "checkpoints"))
  with pytest.raises(ConfigError, match=r"^--workdir: no intact checkpoint in .*step 6: .*"
                     r"does not match its checksum; step 3: .*does not match its checksum"):
    run(tmp_path)
  assert sorted(os.listdir(tmp_path / "checkpoints")) == before
  assert not os.path.exists(tmp_path / "checkpoints.damaged")


def test_the_nan_stop_names_the_newest_checkpoint_that_verifies(tmp_path, monkeypatch):
  original, calls = checkpoint_lib.Checkpointer.save, {"n": 0}

  def save_then_damage(self, step, *a, **kw):    # checkpoint 6 is damaged once written
    original(self, step, *a, **kw)
    if step == 6:
      flip(self.folder(step))
  monkeypatch.setattr(checkpoint_lib.Checkpointer, "save", save_then_damage)
  step = engine_lib.Engine.train_step

  def nan_at_8(self, *a, **kw):
    calls["n"] += 1
    state, m = step(self, *a, **kw)
    return state, (dict(m, loss=jnp.float32(jnp.nan)) if calls["n"] == 8 else m)
  monkeypatch.setattr(engine_lib.Engine, "train_step", nan_at_8)
  with pytest.raises(FloatingPointError, match=r"at step 8: training stopped. The last good "
                     r"checkpoint \(step 3\)"):
    run(tmp_path, steps=9)
  assert math.isnan(metrics.read_jsonl(os.path.join(tmp_path, "metrics.jsonl"))[-1]["train/loss"])
