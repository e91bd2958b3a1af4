"""MetricWriter (JSONL + TensorBoard), the readers, and Progress (host-side; nothing compiled)."""

import glob
import json
import os
import re
import stat

import ml_collections
import numpy as np
import pytest

from semijax.train import metrics

# TensorBoard stores float32 simple_values; these are exact in float32.
LOSSES = {0: 2.5, 10: 1.75, 20: 1.125, 30: 0.8125}


def _write_losses(workdir, steps, **kw):
  with metrics.MetricWriter(str(workdir), enabled=True, **kw) as w:
    for step in steps:
      w.write(step, {"train/loss": LOSSES[step], "train/lr": step * 0.5})


def _steps(records):
  return [r["step"] for r in records]


def test_jsonl_round_trips_exact_steps_and_values(tmp_path):
  with metrics.MetricWriter(str(tmp_path), enabled=True) as w:
    w.write(3, {"train/loss": 0.1, "val/accuracy": np.float32(0.75)})
    w.write(7, {"train/loss": 1 / 3})
  lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
  assert len(lines) == 2
  assert metrics.read_jsonl(str(tmp_path / "metrics.jsonl")) == [
      {"step": 3, "train/loss": 0.1, "val/accuracy": 0.75},
      {"step": 7, "train/loss": 1 / 3},
  ]


def test_write_rejects_a_step_key(tmp_path):
  with metrics.MetricWriter(str(tmp_path), enabled=True) as w:
    with pytest.raises(ValueError, match="step"):
      w.write(1, {"step": 2.0})


def test_tensorboard_holds_exactly_the_written_scalars(tmp_path):
  _write_losses(tmp_path, [0, 10, 20])
  assert glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))
  assert metrics.read_tensorboard(str(tmp_path / "tensorboard")) == {
      "train/loss": [(0, 2.5), (10, 1.75), (20, 1.125)],
      "train/lr": [(0, 0.0), (10, 5.0), (20, 10.0)],
  }


def test_resume_drops_only_later_steps_then_appends(tmp_path):
  _write_losses(tmp_path, [0, 10, 20, 30])
  _write_losses(tmp_path, [20, 30], resume_step=10)      # resumed from the step-10 checkpoint
  records = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert _steps(records) == [0, 10, 20, 30]
  assert [r["train/loss"] for r in records] == [LOSSES[s] for s in (0, 10, 20, 30)]
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]
  # Both runs' event files remain; the resumed writer's purge hides the first run's 20 and 30.
  assert len(glob.glob(str(tmp_path / "tensorboard" / "events.out.tfevents.*"))) == 2
  tb = metrics.read_tensorboard(str(tmp_path / "tensorboard"))
  assert tb["train/loss"] == [(s, LOSSES[s]) for s in (0, 10, 20, 30)]


def test_resume_keeps_the_resume_step_and_survives_a_torn_last_line(tmp_path):
  _write_losses(tmp_path, [0, 10, 20])
  with open(tmp_path / "metrics.jsonl", "a") as f:
    f.write('{"step": 30, "train/lo')                       # a crash mid-write
  assert _steps(metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))) == [0, 10, 20]
  _write_losses(tmp_path, [30], resume_step=20)
  assert _steps(metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))) == [0, 10, 20, 30]


def test_append_without_resume_keeps_everything(tmp_path):
  _write_losses(tmp_path, [0, 10])
  _write_losses(tmp_path, [10, 20])
  assert _steps(metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))) == [0, 10, 10, 20]


def test_disabled_writer_creates_nothing(tmp_path):
  workdir = tmp_path / "run"
  with metrics.MetricWriter(str(workdir), enabled=False, resume_step=5) as w:
    w.write(1, {"train/loss": 1.0})
    assert w.write_config({"a": 1}) == str(workdir / "config.json")
  assert not workdir.exists()
  assert not list(tmp_path.iterdir())


def test_default_enabled_on_process_zero(tmp_path):
  with metrics.MetricWriter(str(tmp_path / "run")) as w:
    assert w.enabled
    w.write(0, {"train/loss": 1.0})
  assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_write_config_is_json_equal_to_the_config(tmp_path):
  config = ml_collections.ConfigDict()
  config.lr = 3e-4
  config.name = "tiny"
  config.model = {"num_layers": 2, "widths": (64, 128), "act": {"kind": "gelu"}}
  config.mesh_shape = (2, 4)
  with metrics.MetricWriter(str(tmp_path), enabled=True) as w:
    path = w.write_config(config)
  assert path == str(tmp_path / "config.json")
  with open(path) as f:
    loaded = json.load(f)
  assert loaded == {"lr": 3e-4, "name": "tiny", "mesh_shape": [2, 4],
                    "model": {"num_layers": 2, "widths": [64, 128], "act": {"kind": "gelu"}}}
  text = (tmp_path / "config.json").read_text()
  assert text.index('"lr"') < text.index('"mesh_shape"') < text.index('"model"')   # sorted
  assert metrics.read_tensorboard(str(tmp_path / "tensorboard")) == {}   # text is not a scalar


def test_write_config_accepts_a_plain_dict(tmp_path):
  with metrics.MetricWriter(str(tmp_path), enabled=True) as w:
    path = w.write_config({"b": (1, 2), "a": {"c": None}})
  with open(path) as f:
    assert json.load(f) == {"a": {"c": None}, "b": [1, 2]}


@pytest.fixture(params=[0o022, 0o002], ids=["umask022", "umask002"])
def umask(request):
  old = os.umask(request.param)
  yield request.param
  os.umask(old)


def _mode(path):
  return stat.S_IMODE(os.stat(path).st_mode)


def test_config_and_resumed_jsonl_get_the_mode_of_any_new_file(tmp_path, umask):
  _write_losses(tmp_path, [0, 10, 20])
  with metrics.MetricWriter(str(tmp_path), enabled=True, resume_step=10) as w:   # rewrites jsonl
    w.write_config({"a": 1})
  (tmp_path / "plain.txt").write_text("x")
  assert _mode(tmp_path / "plain.txt") == 0o666 & ~umask
  assert _mode(tmp_path / "config.json") == 0o666 & ~umask
  assert _mode(tmp_path / "metrics.jsonl") == 0o666 & ~umask
  assert not [n for n in os.listdir(tmp_path) if n.startswith(".tmp")]


def test_rewrites_keep_an_existing_files_mode(tmp_path):
  _write_losses(tmp_path, [0, 10, 20])
  with metrics.MetricWriter(str(tmp_path), enabled=True) as w:
    w.write_config({"a": 1})
  os.chmod(tmp_path / "config.json", 0o640)
  os.chmod(tmp_path / "metrics.jsonl", 0o604)
  with metrics.MetricWriter(str(tmp_path), enabled=True, resume_step=10) as w:
    w.write_config({"a": 2})
  assert _mode(tmp_path / "config.json") == 0o640
  assert _mode(tmp_path / "metrics.jsonl") == 0o604
  assert json.loads((tmp_path / "config.json").read_text()) == {"a": 2}
  assert _steps(metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))) == [0, 10]


def test_read_tensorboard_reads_subdirectories(tmp_path):
  _write_losses(tmp_path / "a", [0])
  _write_losses(tmp_path / "b", [10])
  assert metrics.read_tensorboard(str(tmp_path))["train/loss"] == [(0, 2.5), (10, 1.75)]


def _eta_seconds(line):
  h, m, s = map(int, re.search(r"eta (\d+):(\d\d):(\d\d)", line).groups())
  return 3600 * h + 60 * m + s


def test_progress_line_shows_step_throughput_and_scalars():
  p = metrics.Progress(200)
  line = p.line(40, 0.084, 1024.0, {"train/loss": 2.31414, "val/accuracy": 0.5})
  assert line.startswith("step  40/200 | ")
  assert "loss 2.3141" in line and "accuracy 0.5000" in line and "train/" not in line
  assert "12,190 tokens/s" in line                          # 1024 / 0.084 = 12,190.48
  assert "0.084 s/step" in line
  assert _eta_seconds(line) == round(160 * 0.084)


def test_progress_line_of_an_update_counts_batches_and_its_eta_updates_per_batch():
  p = metrics.Progress(60)
  line = p.line(80, 2.0, 512.0, {"train/loss": 1.5}, batches=20.0)
  assert line.startswith("update 80 | 20.0/60 batches | loss 1.5000 | 2.000 s/update | ")
  assert "256 tokens/s" in line
  # 40 batches to go at 4 updates per batch so far, 2 s an update.
  assert _eta_seconds(line) == 40 * 4 * 2


def test_progress_only_shows_passed_scalars_and_keeps_colliding_tags():
  line = metrics.Progress(10, unit="examples").line(1, 0.5, 8, {"train/loss": 1, "val/loss": 2})
  assert "train/loss 1.0000" in line and "val/loss 2.0000" in line
  assert "16 examples/s" in line
  assert "accuracy" not in metrics.Progress(10).line(1, 0.5, 8, {"train/loss": 1})


def test_progress_eta_ignores_compile_step_and_shrinks():
  p = metrics.Progress(1000, start_step=100)
  first = _eta_seconds(p.line(101, 60.0, 1, {}))            # compile step: only sample so far
  assert first == round(899 * 60.0)
  etas = [_eta_seconds(p.line(s, 1.0, 1, {})) for s in (200, 400, 800)]
  assert etas == [800, 600, 200]                            # the 60 s compile step is ignored
  assert p.steps_this_run(800) == 700
  assert _eta_seconds(p.line(1000, 1.0, 1, {})) == 0
