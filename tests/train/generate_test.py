"""Text from a trained run (`train.generate`, experiments/sample.py): a checkpoint of an uneven
4-device GPT or Llama run, or of a GPT pipelined over 2 stages of 2 devices, restored onto one
device, decodes like the dense reference model with the run's parameters; bad input ends in
one line naming the flag."""

import json
import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

import jax

import dense_reference as ref
import helpers as H
import llama_reference as llama_ref
from semijax import models
from semijax.core import mesh as mesh_lib
from semijax.core import pipeline
from semijax.errors import ConfigError
from semijax.models import sampling
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import generate
from semijax.train import loop as train
from semijax.train import optimizer as optimizer_lib
from semijax.train import prepare
from semijax.train import tensor as tensor_lib


def _run(model, tmp_path_factory):
  """The workdir of 3 steps of an uneven 4-device GPT or Llama (4 KV groups of 2 heads), or of
  a 3-layer GPT on 2 stages (2 layers and 1) of 2 devices."""
  if model == "gpt":
    c = H.tiny_gpt(tensor=4, steps=3, mlp=(10, 20, 14, 20), heads=(1, 3, 2, 2))
  elif model == "pipelined":
    c = H.tiny_gpt(tensor=2, steps=3)
    c.mesh.pipe, c.model.num_layers = 2, 3
  else:
    c = H.tiny_run("llama_tiny", dict(seq_len=16, d_model=32, num_heads=8, num_kv_heads=4,
                                      d_ff=64, num_layers=1), 4, 3, mlp=(10, 20, 14, 20),
                   heads=(0, 2, 1, 1))
  out = tmp_path_factory.mktemp(model)
  train.train_and_evaluate(c, str(out))
  return out


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  return _run("gpt", tmp_path_factory)


def reference(workdir):
  """(dense reference logits_fn, its params) of the run's last checkpoint, restored onto the
  run's own 4-device engine."""
  with open(workdir / "config.json") as f:
    run = config_lib.validate(ml_collections.ConfigDict(json.load(f)))
  if run.mesh.pipe > 1:
    engine = pipeline.PipelineEngine(
        *models.build(run.model), mesh_lib.make_pipeline_mesh(
            1, run.mesh.pipe, run.mesh.tensor, jax.devices()[:run.mesh.pipe * run.mesh.tensor]),
        optimizer_lib.make(run.optimizer, run.steps))
  else:
    engine = tensor_lib.build_engine(run)
  ckpt = checkpoint_lib.Checkpointer(str(workdir / "checkpoints"))
  logical, _ = ckpt.restore(engine.abstract_logical(), 3)
  ckpt.close()
  arrays = engine.logical_arrays(logical.params)
  if run.model.name == "llama":
    heads = run.model.kwargs["num_heads"]
    return (lambda p, tokens: llama_ref.logits(p, tokens, heads)), arrays
  graphdef, params = ref.build(ref.GPT, arrays, **run.model.kwargs)
  return (lambda p, tokens: ref.apply(graphdef, p, tokens)), params


@pytest.mark.parametrize("model", ["gpt", "llama", "pipelined"])
def test_a_restored_run_decodes_like_the_dense_reference(model, workdir, tmp_path_factory):
  workdir = workdir if model == "gpt" else _run(model, tmp_path_factory)
  loaded = generate.load(str(workdir))
  assert (loaded.step, loaded.codec.name) == (3, "UTF-8 bytes")
  ref_logits, ref_params = reference(workdir)
  prompt = list(b"import os\ndef f(x):\n")                  # longer than seq_len (16)
  window = np.asarray([prompt[:16]], np.int32)
  np.testing.assert_allclose(loaded.logits(loaded.params, window),
                             ref_logits(ref_params, window), atol=2e-5)
  rerun = sampling.Recomputing(ref_logits, 16)
  got = sampling.generate(loaded.decoder, loaded.params, prompt, 12)
  assert got == sampling.generate(rerun, ref_params, prompt, 12)
  # 5 tokens: 11 new ones read one at a time with the key/value cache, then 3 past the context.
  got = sampling.generate(loaded.decoder, loaded.params, prompt[:5], 14)
  assert got == sampling.generate(rerun, ref_params, prompt[:5], 14)
  text = loaded.sample("import os\ndef f(x):\n", 12)
  assert text.startswith("import os\ndef f(x):\n") and len(text) > len(prompt)
  with pytest.raises(ConfigError, match=r"^--step: no intact checkpoint 2 in .* \(there are "
                     r"\[3\]\)"):
    generate.load(str(workdir), step=2)


def test_a_run_on_token_shards_decodes_with_their_tokenizer(tmp_path):
  prepare.prepare(prepare.Request(os.path.join(H.ROOT, "README.md"), str(tmp_path / "tokens"),
                                  vocab_size=300))
  c = H.tiny_gpt(tensor=2, steps=2)
  c.model.vocab_size = 300
  c.data.name, c.data.path = "tokens", str(tmp_path / "tokens" / "train_*.bin")
  train.train_and_evaluate(c, str(tmp_path / "run"))
  loaded = generate.load(str(tmp_path / "run"))
  assert loaded.codec.name == str(tmp_path / "tokens" / "tokenizer.json")
  prompt = "The demo runs the same GPT"
  ids = loaded.codec.encode(prompt)
  assert len(ids) < len(prompt.encode()) and max(ids) > 256      # merged tokens
  text = loaded.sample(prompt, 6)
  assert text.startswith(prompt) and len(text) > len(prompt)


def test_bad_input_is_one_line_naming_the_flag(workdir, tmp_path):
  with pytest.raises(ConfigError, match=r"^--workdir: .* holds no config.json"):
    generate.load(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(H.tiny_gpt(tensor=2).to_dict()))
  with pytest.raises(ConfigError, match="^--workdir: no checkpoints in"):
    generate.load(str(tmp_path))
  (tmp_path / "config.json").write_text(json.dumps(H.load("vit_digits").to_dict()))
  with pytest.raises(ConfigError, match="^--workdir: the run trained a 'vit' model"):
    generate.load(str(tmp_path))
  script = os.path.join(H.ROOT, "experiments", "sample.py")
  for flags, line in ((["--top_k=300"], "--top_k: 300 is more than the model's 256 tokens"),
                      (["--temperature=-1"], "--temperature: need >= 0, got -1.0")):
    out = subprocess.run([sys.executable, script, f"--workdir={workdir}", *flags],
                         capture_output=True, text=True, timeout=300, cwd=H.ROOT)
    assert out.returncode == 1 and out.stderr.strip().splitlines()[-1] == line, out.stderr
  out = subprocess.run([sys.executable, script, f"--workdir={workdir}", "--prompt=def ",
                        "--tokens=5", "--temperature=0.7", "--top_k=10"],
                       capture_output=True, text=True, timeout=300, cwd=H.ROOT)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines()[0] == f"gpt of {workdir}, step 3; UTF-8 bytes"
  assert out.stdout.splitlines()[1].startswith("def ")
