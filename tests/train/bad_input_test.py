"""Bad input is refused before compiling, naming the field; nothing already saved is lost."""

import os

import numpy as np
import pytest

import helpers as H
from helpers import load, tiny_gpt
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import loop as train
from semijax.train import metrics
from semijax.train import tokens as tokens_lib


def refused(config, workdir, match):
  """Runs train_and_evaluate expecting a ConfigError; returns the backend compiles it caused."""
  with H.count_backend_compiles() as events:
    with pytest.raises(config_lib.ConfigError, match=match):
      train.train_and_evaluate(config, str(workdir))
  return events


@pytest.mark.parametrize("edit, match", [
    (lambda c: c.model.__setattr__("foo", 1), r"^config.model.foo: unknown config key"),
    (lambda c: c.__setattr__("lerning_rate", 1e-3), r"^config.lerning_rate: unknown config key"),
    (lambda c: c.layout.__setattr__("mlp", (10, 10, 10, 10)),
     r"^config.layout.mlp: counts \(10, 10, 10, 10\) sum to 40, but the model has 64 mlp units"),
    (lambda c: c.layout.__setattr__("heads", "4,4"),
     r"^config.layout.heads: 2 counts \(4, 4\) for 4 tensor devices"),
    (lambda c: c.layout.__setattr__("mlp", "lots"), r"^config.layout.mlp: 'lots' is not 'even'"),
    (lambda c: c.layout.__setattr__("heads", (10, -2, 0, 0)),
     r"^config.layout.heads.counts: negative count in \(10, -2, 0, 0\)"),
    (lambda c: c.model.__setattr__("num_heads", 6),
     r"^config.model.num_heads: 6 heads do not divide the model width d_model=32"),
    (lambda c: c.hetero.__setattr__("slowdown", (1.0, 4.0, 1.0)),
     r"^config.hetero.slowdown: 3 factors \(1.0, 4.0, 1.0\) for mesh.tensor = 4 devices"),
    (lambda c: c.hetero.__setattr__("slowdown", (1.0, -4.0, 1.0, 1.0)),
     r"^config.hetero.slowdown: every factor must be a positive finite number, got -4.0"),
    (lambda c: c.mesh.__setattr__("tensor", 16),
     r"^config.mesh: data \* pipe \* tensor = 1 \* 1 \* 16"),
    (lambda c: c.__setattr__("batch_size", 7),
     r"^config.batch_size: 7 is not divisible by mesh.data \* processes = 2 \* 1"),
    (lambda c: c.data.update(name="text_file", path="/no/such/corpus.txt"),
     r"^config.data.path: no such file"),
    (lambda c: c.data.update(name="tokens", path="/no/such/shards/*.bin"),
     r"^config.data.path: no token shard matches '/no/such/shards/\*.bin'"),
    (lambda c: c.data.update(val_path="/data/val.bin"),
     r"^config.data.val_path: '/data/val.bin' is for data.name 'tokens' only, not 'pydoc'"),
    (lambda c: c.model.__setattr__("dtype", "bf16"),
     r"^config.model.dtype: 'bf16' is not one of \('float32', 'bfloat16', 'float16'\)"),
    (lambda c: c.model.__setattr__("param_dtype", "int8"), r"^config.model.param_dtype: 'int8'"),
    (lambda c: c.model.__setattr__("dtype", "float16"),
     r"^config.model.dtype: 'float16' does not run on the CPU backend"),
    (lambda c: c.model.__setattr__("attention", "flash"), r"^config.model.attention: 'flash'"),
    (lambda c: c.model.update(dtype="bfloat16", attention="cudnn"),
     r"^config.model.attention: 'cudnn' needs a CUDA GPU, but the backend is 'cpu'"),
    (lambda c: c.model.__setattr__("attention", "cudnn"),
     r"^config.model.attention: 'cudnn' needs model.dtype bfloat16 or float16, got 'float32'"),
    (lambda c: c.optimizer.__setattr__("mu_dtype", "half"), r"^config.optimizer.mu_dtype: 'half'"),
    (lambda c: c.layout.__setattr__("kernel", "cond"),
     r"^config.layout.kernel: 'cond' is not one of \('switch', 'pallas', 'auto'\)"),
    (lambda c: c.model.__setattr__("remat_policy", "all"),
     r"^config.model.remat_policy: 'all' is not one of \('none', 'full', 'minimal'\)"),
    (lambda c: (c.model.__setattr__("remat_policy", "full"), c.layout.__setattr__("kernel",
                                                                                   "pallas")),
     r"^config.model.remat_policy: 'full' with layout.kernel 'pallas' needs a GPU or TPU"),
    (lambda c: c.__setattr__("gradient_accumulation_steps", 0),
     r"^config.gradient_accumulation_steps: must be an integer >= 1, got 0"),
    (lambda c: c.__setattr__("gradient_accumulation_steps", 3),
     r"^config.gradient_accumulation_steps: batch_size 8 does not split into 3 microbatches"),
    (lambda c: c.update(gradient_accumulation_steps=2, mesh={"pipe": 2, "tensor": 2},
                          model={"num_layers": 2}),
     r"^config.gradient_accumulation_steps: pipelined and planned runs"),
])
def test_bad_config_is_refused_before_compiling(tmp_path, edit, match):
  config = tiny_gpt()
  config.mesh.data = 2 if "batch_size" in match else 1
  with config.unlocked():
    edit(config)
  assert refused(config, tmp_path, match) == []
  assert not os.path.exists(tmp_path / "checkpoints")


def test_token_shards_of_another_vocabulary_are_refused_before_compiling(tmp_path):
  tokens_lib.write_shard(str(tmp_path / "train.bin"), np.arange(5000) % 300, vocab_size=300,
                         tokenizer="bpe.json")
  config = tiny_gpt()   # model.vocab_size 256
  config.data.update(name="tokens", path=str(tmp_path / "*.bin"))
  match = (r"^config.model.vocab_size: 256 but the token shards' vocabulary is 300 \(header "
           r".*train.bin.json\)$")
  assert refused(config, tmp_path / "run", match) == []
  assert not os.path.exists(tmp_path / "run" / "checkpoints")


def test_bad_config_leaves_an_existing_run_intact(tmp_path):
  config = tiny_gpt(steps=3)
  train.train_and_evaluate(config, str(tmp_path))
  before = sorted(os.listdir(tmp_path / "checkpoints")), (tmp_path / "metrics.jsonl").read_text()
  bad = tiny_gpt(steps=6, mlp=(61, 1, 1, 1))
  bad.hetero.slowdown = (1.0, 2.0)
  refused(bad, tmp_path, r"^config.hetero.slowdown")
  other_model = tiny_gpt(steps=6)
  other_model.model.d_ff = 128
  with pytest.raises(config_lib.ConfigError, match=r"^config.model: the checkpoint at step 3"):
    train.train_and_evaluate(other_model, str(tmp_path))
  after = sorted(os.listdir(tmp_path / "checkpoints")), (tmp_path / "metrics.jsonl").read_text()
  assert before == after


def test_nan_loss_stops_training_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
  rng = np.random.default_rng(0)
  images = rng.random((64, 8, 8, 1)).astype(np.float32)
  np.save(tmp_path / "x.npy", images)
  np.save(tmp_path / "y.npy", rng.integers(0, 10, 64))
  config = load("vit_digits")
  config.model.update(dict(d_model=16, num_heads=8, d_ff=16, num_layers=1))
  config.layout.num_widths = 1
  config.data.update(name="npy", images=str(tmp_path / "x.npy"), labels=str(tmp_path / "y.npy"))
  config.batch_size, config.steps, config.checkpoint_every, config.eval_every = 8, 2, 2, 2
  workdir = str(tmp_path / "run")
  train.train_and_evaluate(config, workdir)
  # The data goes bad (a corrupt file): the next step's loss is NaN.
  images[:] = np.nan
  np.save(tmp_path / "x.npy", images)
  config.steps = 4
  closed = H.record_closes(monkeypatch)
  with pytest.raises(FloatingPointError, match=r"^train/loss is nan at step 3: training stopped. "
                     r"The last good checkpoint \(step 2\)"):
    train.train_and_evaluate(config, workdir)
  # Both closed on the way out (and the one that looked for a finished run, before).
  assert sorted(closed) == ["Checkpointer", "Checkpointer", "DecisionLog"]
  ckpt = checkpoint_lib.Checkpointer(os.path.join(workdir, "checkpoints"))
  assert ckpt.all_steps() == [2]
  engine = train.build_engine(config_lib.validate(config))
  state, meta = ckpt.restore(engine.abstract_logical())
  assert meta["data_position"] == 2
  assert all(np.isfinite(np.asarray(x)).all() for x in H.jax.tree.leaves(state.params))
  assert np.isnan(metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))[-1]["train/loss"])


def test_measuring_speed_by_cpu_share_is_refused_for_accelerators(monkeypatch):
  config = tiny_gpt()
  config.balance.measure = "sched"
  config_lib.validate(config, num_devices=4)                  # CPU devices: it reads them
  monkeypatch.setattr(config_lib.jax, "default_backend", lambda: "gpu")
  with pytest.raises(config_lib.ConfigError,
                     match=r"^config.balance.measure: 'sched' reads the CPU share .* a gpu "
                           r"device's speed; use 'probe' or 'auto'"):
    config_lib.validate(config, num_devices=4)
