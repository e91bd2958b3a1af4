"""Preparing token shards from text: a BPE tokenizer trained offline, shards that round-trip
into training batches, byte-identical reruns, and bad input refused by flag before any work."""

import os
import subprocess
import sys

import ml_collections
import numpy as np
import pytest

from helpers import ROOT, load
from semijax.errors import ConfigError, InputError
from semijax.train import config as config_lib
from semijax.train import data as D
from semijax.train import prepare as P
from semijax.train import tokens as T

EOT = P.EOT
# Each directory's files in name order, then its subdirectories: a.txt, c.txt, sub/b.txt.
DOCS = {
    "a.txt": "def add(x, y):\n    return x + y\n\n" * 12 + "# the quick brown fox\n" * 8,
    "c.txt": "class Fox:\n    '''jumps over the lazy dog'''\n    speed = 3\n" * 10
             + "x = '<|endoftext|>'  # the end token's text is text\n",
    "sub/b.txt": "for i in range(10):\n    print(i * i, 'squared')\n" * 15,
}
ORDER = ("a.txt", "c.txt", "sub/b.txt")
STREAM = "".join(DOCS[name] + EOT for name in ORDER)


def _corpus(tmp_path):
  root = tmp_path / "in"
  for name, text in DOCS.items():
    (root / name).parent.mkdir(parents=True, exist_ok=True)
    (root / name).write_text(text)
  (root / ".hidden.txt").write_text("never read")
  return root


def _prepare(tmp_path, out="out", **kw):
  fields = dict(vocab_size=300, val_fraction=0.2, shard_tokens=400)
  fields.update(kw)
  request = P.Request(str(tmp_path / "in"), str(tmp_path / out), **fields)
  return P.prepare(request, say=lambda line: None)


def _files(directory) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _tokenizer(out):
  return P.tokenizers_module().Tokenizer.from_file(str(out / "tokenizer.json"))


@pytest.fixture(name="prepared")
def _prepared(tmp_path):
  _corpus(tmp_path)
  return _prepare(tmp_path), tmp_path / "out"


def test_text_round_trips_through_shards_into_training_batches(prepared):
  summary, out = prepared
  tokenizer = _tokenizer(out)
  names = sorted(n for n in os.listdir(out) if n.endswith(".bin"))
  assert names == ["train_000.bin", "train_001.bin", "train_002.bin", "val_000.bin"]
  assert sorted(os.listdir(out)) == sorted(names + [n + ".json" for n in names]
                                           + ["tokenizer.json"])
  shards = [T.open_shards(str(out / n)) for n in names]
  stream = np.concatenate([s.tokens[0] for s in shards])
  # The whole stream decodes to the documents, each followed by the end token (id 0, which
  # the literal "<|endoftext|>" in c.txt does not produce), the last 20% of it validating.
  assert tokenizer.decode(stream.tolist(), skip_special_tokens=False) == STREAM
  assert np.flatnonzero(stream == 0).size == len(DOCS) and stream[-1] == 0
  assert len(shards[-1].tokens[0]) == round(len(stream) * 0.2) == summary.val_tokens
  lengths = [len(s.tokens[0]) for s in shards[:3]]
  assert max(lengths) <= 400 and max(lengths) - min(lengths) <= 1
  assert {s.header for s in shards} >= {T.ShardHeader("uint16", 300, "tokenizer.json",
                                                      lengths[0], 0)}
  assert summary.documents == 3 and summary.learned == tokenizer.get_vocab_size() <= 300
  # A training batch's windows decode to text of the stream.
  spec = D.DataSpec.from_config(ml_collections.ConfigDict(dict(
      model=dict(name="gpt", seq_len=24, vocab_size=300), batch_size=8, seed=0,
      data=dict(name="tokens", path=str(out / "train_*.bin"), val_path=str(out / "val_*.bin"),
                val_fraction=0.1, eval_batches=1))))
  dataset = D.build(spec)
  windows = [row for step in range(3) for row in dataset.train_batch(step)["inputs"]]
  texts = [tokenizer.decode(row.tolist(), skip_special_tokens=False) for row in windows]
  assert all(len(t) >= 24 and t in STREAM for t in texts)
  assert any(EOT in t for t in texts)


def test_rerunning_writes_the_same_bytes_and_removes_stale_shards(prepared, tmp_path,
                                                                  monkeypatch):
  _, out = prepared
  first = _files(out)
  (out / "notes.txt").write_text("mine")
  monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")   # one thread: the same tokenizer
  _prepare(tmp_path)
  assert _files(out) == dict(first, **{"notes.txt": b"mine"})
  _prepare(tmp_path, out="again")
  assert _files(tmp_path / "again") == first
  # Larger shards: the stale train_001/002 go, other files stay.
  _prepare(tmp_path, shard_tokens=10_000)
  assert sorted(os.listdir(out)) == ["notes.txt", "tokenizer.json", "train_000.bin",
                                     "train_000.bin.json", "val_000.bin", "val_000.bin.json"]
  assert (out / "tokenizer.json").read_bytes() == first["tokenizer.json"]


def test_a_given_tokenizer_is_used_and_copied(prepared, tmp_path):
  _, out = prepared
  given = tmp_path / "given.json"
  given.write_bytes((out / "tokenizer.json").read_bytes())
  summary = _prepare(tmp_path, out="loaded", vocab_size=None, tokenizer=str(given))
  assert _files(tmp_path / "loaded") == _files(out)
  assert summary.vocab_size == _tokenizer(out).get_vocab_size()


def _bad(tmp_path, **fields):
  base = dict(input=str(tmp_path / "in"), out_dir=str(tmp_path / "out"), vocab_size=300)
  return P.Request(**dict(base, **fields))


@pytest.mark.parametrize("fields, match", [
    (dict(input="/no/such/corpus"), r"--input: no such file or directory: /no/such/corpus \("),
    (dict(input=""), r"--input: need 'stdlib', a text file or a directory"),
    (dict(input="{tmp}/empty"), r"--input: .*empty holds no text \(1 empty file\)$"),
    (dict(input="{tmp}/out"), r"--input: .*out is the --out_dir"),
    (dict(vocab_size=100), r"--vocab_size: need an integer in \[257, 2147483647\], got 100"),
    (dict(vocab_size=True), r"--vocab_size: need an integer"),
    (dict(tokenizer="{tmp}/none.json"), r"--vocab_size: 300 given with --tokenizer"),
    (dict(tokenizer="{tmp}/none.json", vocab_size=None),
     r"--tokenizer: cannot load .*none\.json: no such file"),
    (dict(tokenizer="{tmp}/in/a.txt", vocab_size=None), r"--tokenizer: cannot load .*a\.txt: "),
    (dict(tokenizer="{tmp}/out/tokenizer.json", vocab_size=None, eot_token="<eos>"),
     r"--tokenizer: .*tokenizer\.json has no '<eos>' token"),
    (dict(val_fraction=1.0), r"--val_fraction: need a number strictly between 0 and 1, got 1.0"),
    (dict(val_fraction=1e-6), r"--val_fraction: 1e-06 of \d+ tokens leaves no validation token"),
    (dict(shard_tokens=0), r"--shard_tokens: need an integer in \[1, "),
    (dict(out_dir="{tmp}/in/a.txt"), r"--out_dir: .*a\.txt is a file, not a directory"),
    (dict(out_dir=""), r"--out_dir: need a directory"),
    (dict(eot_token=""), r"--eot_token: need a non-empty string"),
])
def test_bad_input_is_refused_by_flag_and_leaves_the_output_as_it_was(prepared, tmp_path,
                                                                      fields, match):
  _, out = prepared
  before = _files(out)
  (tmp_path / "empty").mkdir()
  (tmp_path / "empty" / "nothing.txt").write_text("")
  fields = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in fields.items()}
  with pytest.raises(InputError, match="^" + match):
    P.prepare(_bad(tmp_path, **fields), say=lambda line: None)
  assert _files(out) == before


def test_a_failure_while_writing_leaves_the_output_as_it_was(prepared, tmp_path, monkeypatch):
  _, out = prepared
  before = _files(out)
  written, write_shard = [], T.write_shard

  def write_then_fail(path, *args, **kw):
    if written:
      raise OSError("disk full")
    written.append(write_shard(path, *args, **kw))
  monkeypatch.setattr(T, "write_shard", write_then_fail)
  with pytest.raises(OSError, match="disk full"):
    _prepare(tmp_path, shard_tokens=10_000)
  assert written and _files(out) == before


def test_missing_tokenizers_names_the_extra(monkeypatch, tmp_path):
  monkeypatch.setitem(sys.modules, "tokenizers", None)
  with pytest.raises(InputError, match=r"^tokenizers: not installed; .*pip install -e "
                                       r"'\.\[data\]'"):
    P.prepare(_bad(tmp_path), say=lambda line: None)


def test_the_stdlib_input_is_the_stdlib_corpus():
  files = P.input_files(P.STDLIB)
  joined = b"\n\n".join(open(f, "rb").read() for f in files)
  assert joined == D.stdlib_corpus()


def test_pieces_cut_after_newlines_and_join_to_the_text():
  text = "ab\ncdef\n" * 5 + "x" * 12
  parts = list(P.pieces(text, size=10))
  assert "".join(parts) == text
  assert all(p.endswith("\n") for p in parts[:-2]) and all(len(p) <= 10 for p in parts)


@pytest.mark.parametrize("spec", ["gpt_tiny:", "gpt_tiny:tensor=1", "gpt_gpu:"])
def test_the_gpu_configs_read_the_tokenized_stdlib(spec, tmp_path, monkeypatch):
  name, arg = spec.split(":")
  config = load(name, arg)
  assert (config.data.name, config.model.vocab_size) == ("tokens", 4096)
  assert config.data.path == "data/stdlib_bpe4k/train_*.bin"
  assert config.data.val_path == "data/stdlib_bpe4k/val_*.bin"
  run = config_lib.validate(config, 8, 1)
  monkeypatch.chdir(tmp_path)   # no data/ here
  with pytest.raises(ConfigError, match=(
      r"^config\.data\.path: no token shard matches 'data/stdlib_bpe4k/train_\*\.bin'; python "
      r"experiments/prepare_data\.py --out_dir=data/stdlib_bpe4k writes them")):
    D.build(run.data)


def test_the_cpu_variant_stays_byte_level():
  config = load("gpt_tiny", "cpu")
  assert (config.data.name, config.data.path, config.model.vocab_size) == ("pydoc", "", 256)


def test_the_documented_command_prepares_what_the_default_config_trains_on(tmp_path,
                                                                          monkeypatch):
  monkeypatch.chdir(tmp_path)
  summary = P.prepare(P.Request(P.STDLIB, P.STDLIB_DIR, vocab_size=4096), say=lambda line: None)
  assert summary.learned == 4096 and summary.eot == 0
  assert summary.val_tokens == round(0.1 * (summary.train_tokens + summary.val_tokens))
  dataset = D.build(config_lib.validate(load("gpt_tiny", ""), 8, 1).data)
  batch = dataset.train_batch(0)["inputs"]
  assert batch.shape == (64, 256) and 0 <= batch.min() and batch.max() < 4096
  assert len(dataset.eval_batches()) == 4


def _cli(*args, cwd):
  return subprocess.Popen([sys.executable, os.path.join(ROOT, "experiments", "prepare_data.py"),
                           *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True)


def test_the_command_line_refuses_bad_input_in_one_line_and_reports_what_it_wrote(tmp_path):
  _corpus(tmp_path)
  runs = {
      "--vocab_size: need an integer in [257, 2147483647], got 100":
          _cli("--input=in", "--out_dir=out", "--vocab_size=100", cwd=tmp_path),
      "--input: no such file or directory: nope (or 'stdlib' for the standard library's "
      "sources)": _cli("--input=nope", "--out_dir=out", cwd=tmp_path),
      None: _cli("--input=in", "--out_dir=good", "--vocab_size=300", cwd=tmp_path),
  }
  for last_line, run in runs.items():
    stdout, stderr = run.communicate(timeout=120)
    if last_line is None:
      assert run.returncode == 0, stderr
      assert "  encoding: [####################] 100%" in stdout
      assert stdout.splitlines()[-1] == (
          "train on them: --config.data.name=tokens --config.data.path='good/train_*.bin' "
          "--config.data.val_path='good/val_*.bin' --config.model.vocab_size=300")
    else:
      assert run.returncode == 1 and stderr.splitlines() == [last_line], stderr
  assert not os.path.exists(tmp_path / "out")
