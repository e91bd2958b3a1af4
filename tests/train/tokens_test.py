"""Token shards on disk: writing them, reading them into batches, and refusing bad ones."""

import json
import os
import resource

import ml_collections
import numpy as np
import pytest

from helpers import tiny_gpt
from semijax.errors import ConfigError
from semijax.train import data as D
from semijax.train import loop
from semijax.train import tokens as T


def _config(path, vocab_size=6000, **data):
  """A GPT config reading the token shards at `path`."""
  fields = dict(name="tokens", path=str(path), val_path="", val_fraction=0.1, eval_batches=2)
  fields.update(data)
  return ml_collections.ConfigDict(dict(
      model=dict(name="gpt", seq_len=16, vocab_size=vocab_size), data=fields, batch_size=4,
      seed=0))


def _build(config, **kw):
  return D.build(D.DataSpec.from_config(config), **kw)


def _two_shards(tmp_path):
  """Shards a.bin (ids 0..2999) and b.bin (ids 3500..5499) of a 6000-token vocabulary: a
  window that straddled them would not be consecutive ids."""
  T.write_shard(str(tmp_path / "a.bin"), np.arange(3000), vocab_size=6000, tokenizer="t.json")
  T.write_shard(str(tmp_path / "b.bin"), np.arange(3500, 5500), vocab_size=6000,
                tokenizer="t.json")
  return tmp_path / "*.bin"


def _windows(batch) -> np.ndarray:
  """int32 [B, seq_len + 1]: the windows a batch was cut from."""
  return np.c_[batch["inputs"], batch["targets"][:, -1:]]


# --- writing ---------------------------------------------------------------------------------


def test_write_shard_layout_header_and_identical_rewrite(tmp_path):
  tokens = np.array([5, 0, 299, 7], np.int64)
  path = str(tmp_path / "s.bin")
  header = T.write_shard(path, tokens, vocab_size=300, tokenizer="bytes+bpe.json", eot=0)
  assert (tmp_path / "s.bin").read_bytes() == tokens.astype("<u2").tobytes()   # no header inside
  assert json.loads((tmp_path / "s.bin.json").read_text()) == {
      "dtype": "uint16", "vocab_size": 300, "tokenizer": "bytes+bpe.json", "num_tokens": 4,
      "eot": 0}
  assert header == T.read_header(path, "config.data.path")
  before = [(tmp_path / n).read_bytes() for n in ("s.bin", "s.bin.json")]
  T.write_shard(path, tokens.astype(np.uint16), vocab_size=300, tokenizer="bytes+bpe.json", eot=0)
  assert [(tmp_path / n).read_bytes() for n in ("s.bin", "s.bin.json")] == before
  assert sorted(os.listdir(tmp_path)) == ["s.bin", "s.bin.json"]   # no temporary file left
  big = T.write_shard(str(tmp_path / "u.bin"), [70_000, 1], vocab_size=70_001, tokenizer="x")
  assert big.dtype == "uint32" and big.eot is None
  assert (tmp_path / "u.bin").read_bytes() == np.array([70_000, 1], "<u4").tobytes()


@pytest.mark.parametrize("tokens, kw, match", [
    ([1, 300], {}, r"^tokens: ids span \[1, 300\], outside \[0, 300\)"),
    ([-1, 2], {}, r"^tokens: ids span"),
    ([], {}, r"^tokens: need a non-empty 1-D integer array"),
    ([[1, 2]], {}, r"^tokens: need a non-empty 1-D"),
    ([1.0, 2.0], {}, r"^tokens: need a non-empty 1-D integer array, got float64"),
    ([1], {"eot": 300}, r"^eot: "),
    ([1], {"tokenizer": ""}, r"^tokenizer: "),
    ([1], {"vocab_size": 0}, r"^vocab_size: "),
])
def test_write_shard_refuses_what_cannot_be_a_shard(tmp_path, tokens, kw, match):
  args = dict(vocab_size=300, tokenizer="t")
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    T.write_shard(str(tmp_path / "s.bin"), np.array(tokens), **args)
  assert not os.listdir(tmp_path)


# --- reading into batches --------------------------------------------------------------------


def test_round_trip_tokens_shard_training_batch(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 50257, 5000)
  T.write_shard(str(tmp_path / "train.bin"), tokens, vocab_size=50257, tokenizer="gpt2.json",
                eot=50256)
  ds = _build(_config(tmp_path / "train.bin", vocab_size=50257))
  assert isinstance(ds.train[0], np.memmap) and ds.train[0].dtype == np.dtype("<u2")
  train, val = tokens[:4500], tokens[4500:]   # the last val_fraction validates
  for step in range(5):
    batch = ds.train_batch(step)
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32
    assert batch["inputs"].shape == (4, 16)
    np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    _, starts = ds.global_windows(step)
    for s, window in zip(starts, _windows(batch)):
      assert s + 17 <= len(train)
      np.testing.assert_array_equal(window, train[s:s + 17])
  evals = [_windows(b) for b in ds.eval_batches()]
  np.testing.assert_array_equal(np.concatenate(evals), val[:8 * 17].reshape(8, 17))


def test_windows_never_straddle_shards_and_processes_share_global_batches(tmp_path):
  config = _config(_two_shards(tmp_path))
  full = _build(config)
  assert [len(p) for p in full.train] == [3000, 1500] and [len(p) for p in full.val] == [500]
  rows = np.concatenate([_windows(full.train_batch(s)) for s in range(200)])
  np.testing.assert_array_equal(np.diff(rows), 1)   # consecutive ids: inside one shard
  in_b = np.mean(rows[:, 0] >= 3500)
  assert 0.25 < in_b < 0.42   # chosen by usable windows: 1484 of 4468 = 0.33
  parts = [_build(config, process_index=p, process_count=2) for p in range(2)]
  for step in (0, 11):
    for key in ("inputs", "targets"):
      got = np.concatenate([p.train_batch(step)[key] for p in parts])
      np.testing.assert_array_equal(got, full.train_batch(step)[key])
  again = _build(config)   # a resumed run: the batch is a function of (seed, step) alone
  np.testing.assert_array_equal(again.train_batch(11)["inputs"], full.train_batch(11)["inputs"])
  config.seed = 1
  assert not np.array_equal(_build(config).train_batch(11)["inputs"],
                            full.train_batch(11)["inputs"])


def test_val_path_shards_validate_and_the_train_shards_all_train(tmp_path):
  pattern = _two_shards(tmp_path)
  (tmp_path / "val").mkdir()
  T.write_shard(str(tmp_path / "val" / "v.bin"), np.arange(5500, 5900), vocab_size=6000,
                tokenizer="t.json")
  ds = _build(_config(pattern, val_path=str(tmp_path / "val" / "*.bin")))
  assert [len(p) for p in ds.train] == [3000, 2000] and [len(p) for p in ds.val] == [400]
  evals = np.concatenate([_windows(b) for b in ds.eval_batches()])
  np.testing.assert_array_equal(evals, np.arange(5500, 5500 + 8 * 17).reshape(8, 17))
  rows = np.concatenate([_windows(ds.train_batch(s)) for s in range(100)])
  assert rows.max() < 5500 and rows.max() > 5000   # b.bin's tail trains now


def test_a_4gb_shard_is_mapped_not_read(tmp_path):
  path = tmp_path / "big.bin"
  num_tokens = 2**31   # uint16: 4 GiB, sparse (no disk blocks, zeros when read)
  with open(path, "wb") as f:
    f.truncate(num_tokens * 2)
  (tmp_path / "big.bin.json").write_text(json.dumps(dict(
      dtype="uint16", vocab_size=50257, tokenizer="gpt2.json", num_tokens=num_tokens, eot=None)))
  page = os.sysconf("SC_PAGE_SIZE")
  resident = lambda: int(open("/proc/self/statm").read().split()[1]) * page
  rss, peak = resident(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
  config = _config(path, vocab_size=50257)
  config.model.seq_len, config.batch_size = 1024, 32
  ds = _build(config)
  batches = [ds.train_batch(step) for step in range(4)] + ds.eval_batches()
  grown = resident() - rss
  peak_grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - peak
  print(f"resident memory growth: {grown / 2**20:.1f} MiB, peak growth "
        f"{peak_grown / 2**20:.1f} MiB, for a {num_tokens * 2 / 2**30:.0f} GiB shard")
  assert ds.num_train_tokens + sum(len(p) for p in ds.val) == num_tokens
  assert all(b["inputs"].shape == (32, 1024) and not b["inputs"].any() for b in batches)
  assert grown < 200 * 2**20 and peak_grown < 200 * 2**20


# --- bad shards ------------------------------------------------------------------------------


def _raw_shard(path, data: bytes, **header):
  """Writes `data` at `path` and `header` (a valid uint16 one, updated) beside it."""
  fields = dict(dtype="uint16", vocab_size=6000, tokenizer="t.json", num_tokens=len(data) // 2,
                eot=None)
  fields.update(header)
  path.write_bytes(data)
  (path.parent / (path.name + ".json")).write_text(json.dumps(fields))


def _no_header(tmp_path):
  (tmp_path / "a.bin").write_bytes(b"\0" * 100)


def _edit_header(**fields):
  def make(tmp_path):
    _raw_shard(tmp_path / "a.bin", b"\0" * 100, **fields)
  return make


def _other_shard(**header):
  def make(tmp_path):
    _two_shards(tmp_path)
    data = (tmp_path / "b.bin").read_bytes()
    if header.get("dtype") == "uint32":
      data = np.frombuffer(data, "<u2").astype("<u4").tobytes()
    _raw_shard(tmp_path / "b.bin", data, num_tokens=2000, **header)
  return make


def _bad_val(tmp_path):
  _two_shards(tmp_path)
  T.write_shard(str(tmp_path / "v.val"), np.arange(400), vocab_size=5000, tokenizer="t.json")


@pytest.mark.parametrize("make, data, pattern", [
    (None, dict(path="nothing/*.bin"), r"config\.data\.path: no token shard matches '.*nothing"),
    (None, dict(path=""), r"config\.data\.path: no token shard matches ''"),
    (_no_header, {}, r"config\.data\.path: .*a\.bin has no header .*a\.bin\.json"),
    (_edit_header(num_tokens=51), {},
     r"config\.data\.path: .*a\.bin holds 100 bytes, but its header .*a\.bin\.json says 51 "
     r"uint16 tokens \(102 bytes\)"),
    (_edit_header(dtype="uint32"), {}, r"config\.data\.path: .*holds 100 bytes, but .* says 50 "
     r"uint32 tokens \(200 bytes\)"),
    (_edit_header(dtype="int8"), {},
     r"config\.data\.path: header .*a\.bin\.json: dtype 'int8' is not one of \('uint16', "
     r"'uint32'\)"),
    (_edit_header(num_tokens=0), {}, r"config\.data\.path: .*a\.bin is empty"),
    (lambda p: _raw_shard(p / "a.bin", b""), {}, r"config\.data\.path: .*a\.bin is empty"),
    (_edit_header(vocab_size=70_000), {},
     r"config\.data\.path: header .*: vocab_size 70000 is not an integer in \[1, 65536\]"),
    (_edit_header(eot=6000), {}, r"config\.data\.path: header .*: eot 6000 is not null"),
    (_edit_header(tokenizer=None), {}, r"config\.data\.path: header .*: tokenizer None"),
    (_edit_header(num_tokens="50"), {}, r"config\.data\.path: header .*: num_tokens '50'"),
    (lambda p: (_no_header(p), (p / "a.bin.json").write_text("{")), {},
     r"config\.data\.path: cannot read the header .*a\.bin\.json as JSON"),
    (lambda p: (_no_header(p), (p / "a.bin.json").write_text('{"dtype": "uint16"}')), {},
     r"config\.data\.path: header .*: lacks \['vocab_size', 'tokenizer', 'num_tokens', 'eot'\]"),
    (_other_shard(vocab_size=7000), {},
     r"config\.data\.path: .*b\.bin has vocabulary \{.*'vocab_size': 7000.*\}, but .*a\.bin\.json "
     r"says \{.*'vocab_size': 6000.*\}; all shards must share one"),
    (_other_shard(dtype="uint32"), {}, r"config\.data\.path: .*b\.bin has vocabulary "
     r"\{'dtype': 'uint32'.*all shards must share one"),
    (_other_shard(tokenizer="other.json"), {}, r"config\.data\.path: .*b\.bin has vocabulary"),
    (_two_shards, dict(vocab_size=256),
     r"config\.model\.vocab_size: 256 but the token shards' vocabulary is 6000 \(header "
     r".*a\.bin\.json\)$"),
    (_two_shards, dict(val_path="nothing.bin"),
     r"config\.data\.val_path: no token shard matches '.*nothing\.bin'"),
    (_bad_val, dict(val_path="v.val"), r"config\.data\.val_path: .*v\.val\.json has vocabulary "
     r"\{.*'vocab_size': 5000.*\}, but .*a\.bin\.json says"),
    (_two_shards, dict(val_fraction=0.5, eval_batches=100),
     r"config\.data: the validation part holds \d+ windows"),
])
def test_bad_shards_are_refused_naming_the_field(tmp_path, make, data, pattern):
  if make:
    make(tmp_path)
  data = {"path": "*.bin", **data}
  vocab_size = data.pop("vocab_size", 6000)
  for key in ("path", "val_path"):
    if key in data and data[key]:
      data[key] = str(tmp_path / data[key])
  with pytest.raises(ConfigError, match="^" + pattern):
    _build(_config(data.pop("path"), vocab_size=vocab_size, **data))


def test_val_path_is_for_token_shards_only():
  config = _config("x.bin")
  config.data.update(name="text_file", val_path="v.bin")
  with pytest.raises(ConfigError, match=r"^config\.data\.val_path: 'v\.bin' is for data\.name "
                     r"'tokens' only, not 'text_file'"):
    D.DataSpec.from_config(config)


def test_a_gpt_of_the_shards_vocabulary_trains_on_them(tmp_path):
  tokens = np.random.default_rng(0).integers(0, 300, 4000)
  T.write_shard(str(tmp_path / "train.bin"), tokens, vocab_size=300, tokenizer="bpe.json")
  config = tiny_gpt(steps=2)
  config.model.vocab_size = 300
  config.data.update(name="tokens", path=str(tmp_path / "train.bin"))
  summary = loop.train_and_evaluate(config, str(tmp_path / "run"))
  assert len(summary["losses"]) == 2 and np.isfinite(summary["val/loss"])
  assert abs(summary["losses"][0] - np.log(300)) < 0.5   # a uniform guess over 300 tokens
