"""Deterministic text and image data: batches, sharding across processes, errors (host-only)."""

import glob
import os
import sysconfig

import ml_collections
import numpy as np
import pytest

from helpers import ROOT
from semijax.errors import ConfigError
from semijax.train import config as config_lib
from semijax.train import data as D
from semijax.train import prepare

TEXT = bytes(range(256)) * 40   # 10240 bytes; every byte value, so windows are easy to locate


def _text(data=TEXT, val_fraction=0.1, **kw):
  """A TextDataset of the bytes `data`, the last `val_fraction` held out."""
  args = dict(seq_len=16, batch_size=8, seed=0, eval_batches=4)
  args.update(kw)
  return D.TextDataset(*D.split_tail([np.frombuffer(data, np.uint8)], val_fraction), **args)


def _parts(lengths, step=1000):
  """Parts [lengths[i]] of int64 ids step * i, step * i + 1, ...: a window's part is its first
  id // step, and a window that straddled two parts would not be consecutive ids."""
  return [np.arange(n) + step * i for i, n in enumerate(lengths)]


def _images(n=100, h=4, w=4, c=1):
  """float32 [n, h, w, c] images whose pixels all equal the example id, int32 labels id % 10."""
  ids = np.arange(n, dtype=np.float32)
  images = np.broadcast_to(ids[:, None, None, None], (n, h, w, c)).copy()
  return images, (np.arange(n) % 10).astype(np.int32)


def _ids(batch):
  """The example ids (see `_images`) of the rows of an image batch."""
  return batch["images"][:, 0, 0, 0].astype(int)


def _gpt_config(**data):
  fields = dict(name="pydoc", path="", val_fraction=0.1, eval_batches=2)
  fields.update(data)
  return ml_collections.ConfigDict(dict(
      model=dict(name="gpt", seq_len=32), data=fields, batch_size=4, seed=0))


def _vit_config(image_size=8, channels=1, num_classes=10, **data):
  fields = dict(name="digits", images="", labels="", val_fraction=0.2)
  fields.update(data)
  return ml_collections.ConfigDict(dict(
      model=dict(name="vit", image_size=image_size, channels=channels, num_classes=num_classes),
      data=fields, batch_size=16, seed=0))


# --- sources ---------------------------------------------------------------------------------


def test_pydoc_corpus_is_large_utf8_and_stable():
  corpus = D.pydoc_corpus()
  assert len(corpus) > 100_000
  text = corpus.decode("utf-8")
  assert "for_stmt" in text or "The for statement" in text
  assert D.pydoc_corpus() == corpus


def test_stdlib_corpus_is_large_deterministic_source_without_tests():
  corpus = D.stdlib_corpus()
  assert len(corpus) > 5_000_000
  assert D.stdlib_corpus() is corpus   # read once per process
  D.stdlib_corpus.cache_clear()
  assert D.stdlib_corpus() == corpus   # read again: the same bytes
  with open(os.__file__, "rb") as f:
    assert f.read() in corpus           # os.py is in the standard library
  test_file = os.path.join(sysconfig.get_paths()["stdlib"], "test", "test_os.py")
  if os.path.exists(test_file):         # (some distributions leave the test suite out)
    with open(test_file, "rb") as f:
      assert f.read() not in corpus


def test_python_sources_order_and_what_it_skips(tmp_path):
  files = {"b.py": b"B", "a.py": b"A", "notes.txt": b"T", "pkg/c.py": b"C", "pkg/sub/d.py": b"D",
           "test/t.py": b"X", "pkg/tests/t.py": b"X", "site-packages/s.py": b"X",
           "__pycache__/p.py": b"X"}
  for name, data in files.items():
    (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / name).write_bytes(data)
  (tmp_path / "dead.py").symlink_to(tmp_path / "missing.py")   # unreadable
  (tmp_path / "dir.py").mkdir()
  os.mkfifo(tmp_path / "fifo.py")                               # would block a read
  assert D.python_sources(str(tmp_path)) == b"A\n\nB\n\nC\n\nD"
  assert D.python_sources(str(tmp_path / "nothing")) == b""


def test_read_text_file(tmp_path):
  p = tmp_path / "a.txt"
  p.write_bytes(b"hello")
  assert D.read_text_file(str(p)) == b"hello"
  with pytest.raises(ConfigError, match=r"^config\.data\.path: no such file: .*missing"):
    D.read_text_file(str(tmp_path / "missing"))
  with pytest.raises(ConfigError, match=r"^config\.data\.path: "):
    D.read_text_file(str(tmp_path))   # a directory
  (tmp_path / "empty.txt").write_bytes(b"")
  with pytest.raises(ConfigError, match=r"^config\.data\.path: .* is empty"):
    D.read_text_file(str(tmp_path / "empty.txt"))


def test_digits():
  pytest.importorskip("sklearn")
  images, labels = D.digits()
  assert images.shape == (1797, 8, 8, 1) and images.dtype == np.float32
  assert labels.shape == (1797,) and labels.dtype == np.int32
  assert images.min() == 0.0 and images.max() == 1.0
  assert set(labels.tolist()) == set(range(10))


def test_npy_round_trip(tmp_path):
  images = np.random.default_rng(0).integers(0, 255, (6, 5, 5), dtype=np.uint8)
  labels = np.arange(6, dtype=np.int64)
  np.save(tmp_path / "x.npy", images)
  np.save(tmp_path / "y.npy", labels)
  x, y = D.load_npy_images(str(tmp_path / "x.npy"), str(tmp_path / "y.npy"))
  assert x.shape == (6, 5, 5, 1) and x.dtype == np.float32
  np.testing.assert_array_equal(x[..., 0], images)
  assert y.dtype == np.int32
  np.testing.assert_array_equal(y, labels)
  np.save(tmp_path / "x4.npy", np.zeros((6, 5, 5, 3), np.float64))
  x, _ = D.load_npy_images(str(tmp_path / "x4.npy"), str(tmp_path / "y.npy"))
  assert x.shape == (6, 5, 5, 3) and x.dtype == np.float32


@pytest.mark.parametrize("images, labels, field", [
    ("missing", np.arange(6), "config.data.images"),
    (np.zeros((6, 5, 5)), "missing", "config.data.labels"),
    (np.zeros((6, 5)), np.arange(6), "config.data.images"),              # wrong ndim
    (np.zeros((6, 5, 5, 1, 1)), np.arange(6), "config.data.images"),
    (np.zeros((6, 5, 5)), np.arange(5), "config.data.labels"),           # N mismatch
    (np.zeros((6, 5, 5)), np.arange(6.0), "config.data.labels"),         # float labels
    (np.zeros((6, 5, 5)), np.zeros((6, 1), int), "config.data.labels"),  # labels not [N]
])
def test_npy_errors_name_their_field(tmp_path, images, labels, field):
  paths = []
  for name, value in (("x", images), ("y", labels)):
    path = tmp_path / f"{name}.npy"
    if not isinstance(value, str):
      np.save(path, value)
    paths.append(str(path))
  with pytest.raises(ConfigError, match="^" + field.replace(".", r"\.") + ":"):
    D.load_npy_images(*paths)


# --- text ------------------------------------------------------------------------------------


def test_text_train_batches_deterministic_and_varied():
  ds = _text()
  b = ds.train_batch(3)
  assert b["inputs"].shape == b["targets"].shape == (8, 16)
  assert b["inputs"].dtype == b["targets"].dtype == np.int32
  np.testing.assert_array_equal(b["inputs"], _text().train_batch(3)["inputs"])
  assert not np.array_equal(b["inputs"], ds.train_batch(4)["inputs"])
  assert not np.array_equal(b["inputs"], _text(seed=1).train_batch(3)["inputs"])
  assert ds.tokens_per_example == 16


def test_text_targets_shift_inputs_and_come_from_train():
  ds = _text()
  train = np.frombuffer(TEXT, np.uint8)[:len(TEXT) - round(len(TEXT) * 0.1)]
  assert [len(p) for p in ds.train] == [len(train)]
  assert [len(p) for p in ds.val] == [len(TEXT) - len(train)]
  assert ds.num_train_tokens == len(train)
  for step in range(20):
    b = ds.train_batch(step)
    np.testing.assert_array_equal(b["inputs"][:, 1:], b["targets"][:, :-1])
    part, starts = ds.global_windows(step)
    assert not part.any()
    for s, row_in, row_t in zip(starts, b["inputs"], b["targets"]):
      assert 0 <= s and s + 17 <= len(train)
      np.testing.assert_array_equal(row_in, train[s:s + 16])
      np.testing.assert_array_equal(row_t, train[s + 1:s + 17])


def test_text_windows_reach_the_end_of_train_but_not_val():
  data = bytes(range(20)) + b"\xff" * 400   # train = bytes 0..19, val = 0xff
  ds = _text(data, val_fraction=400 / 420, seq_len=4, batch_size=64, eval_batches=1)
  assert ds.num_train_tokens == 20
  last = [int(ds.train_batch(s)["targets"][:, -1].max()) for s in range(5)]
  assert max(last) == 19   # the last train byte is reachable, no val byte ever is


def test_text_two_processes_concatenate_to_global_batch():
  full = _text()
  parts = [_text(process_index=p, process_count=2) for p in range(2)]
  for step in (0, 7):
    for key in ("inputs", "targets"):
      got = np.concatenate([p.train_batch(step)[key] for p in parts])
      np.testing.assert_array_equal(got, full.train_batch(step)[key])
  for i, batch in enumerate(full.eval_batches()):
    for key in ("inputs", "targets"):
      got = np.concatenate([p.eval_batches()[i][key] for p in parts])
      np.testing.assert_array_equal(got, batch[key])
  assert parts[0].train_batch(0)["inputs"].shape == (4, 16)


def test_text_eval_batches_fixed_consecutive_windows_of_val():
  ds = _text()
  batches = ds.eval_batches()
  assert len(batches) == 4
  other = _text(seed=5).eval_batches()
  windows = np.frombuffer(TEXT, np.uint8)[-len(ds.val[0]):][:4 * 8 * 17].reshape(32, 17)
  for i, b in enumerate(batches):
    assert b["inputs"].shape == (8, 16) and b["inputs"].dtype == np.int32
    np.testing.assert_array_equal(b["inputs"], other[i]["inputs"])
    np.testing.assert_array_equal(b["inputs"], windows[i * 8:(i + 1) * 8, :-1])
    np.testing.assert_array_equal(b["targets"], windows[i * 8:(i + 1) * 8, 1:])


def test_text_too_small_errors():
  with pytest.raises(ConfigError, match=r"^config\.data: the training part has 10 tokens in "
                     r"its longest piece .*\(8 short\)"):
    _text(b"x" * 20, val_fraction=0.5, batch_size=1, eval_batches=1)
  with pytest.raises(ConfigError, match=r"^config\.data: the validation part holds 60 windows "
                     r"of seq_len \+ 1 = 17 tokens, .* = 800 are needed \(740 short\)"):
    _text(eval_batches=100)
  with pytest.raises(ConfigError, match=r"^config\.data: the training part has 17 tokens"):
    D.TextDataset(_parts([17, 17]), _parts([100]), seq_len=16, batch_size=1, seed=0,
                  eval_batches=1)   # two windows, but not two in one part
  with pytest.raises(ConfigError, match=r"^config\.batch_size: "):
    _text(batch_size=6, process_count=4)


def test_split_tail_holds_out_the_last_tokens_across_parts():
  parts = _parts([10, 5, 15])
  train, val = D.split_tail(parts, 0.6)   # 18 of 30 tokens validate: 3 of part 1, all of part 2
  assert [p.tolist() for p in train] == [list(range(10)), [1000, 1001]]
  assert [p.tolist() for p in val] == [[1002, 1003, 1004], list(range(2000, 2015))]
  train, val = D.split_tail(parts, 0.5)   # the cut falls between parts: none left empty
  assert [len(p) for p in train] == [10, 5] and [len(p) for p in val] == [15]
  assert all(np.shares_memory(a, b) for a, b in zip(train, parts))   # views, not copies
  with pytest.raises(ConfigError, match=r"^config\.data\.val_fraction: "):
    D.split_tail(parts, 1.0)


def test_text_windows_stay_inside_one_part_chosen_by_its_windows():
  # Windows of 17 tokens: 100 start in part 0, none in part 1 (too short), 10 in part 2.
  ds = D.TextDataset(_parts([116, 12, 26]), _parts([17 * 64]), seq_len=16, batch_size=64,
                     seed=0, eval_batches=1)
  rows = np.concatenate([ds.train_batch(step)["inputs"] for step in range(50)])   # 3200 rows
  targets = np.concatenate([ds.train_batch(step)["targets"] for step in range(50)])
  np.testing.assert_array_equal(np.diff(np.c_[rows, targets[:, -1]]), 1)   # never straddle
  part = rows[:, 0] // 1000
  assert set(part.tolist()) == {0, 2}
  assert 0.07 < np.mean(part == 2) < 0.115   # 10 / 110 = 0.091 of the windows
  assert rows[part == 2, 0].max() - 2000 == 9 and rows[part == 0, 0].max() == 99   # every start
  part, starts = ds.global_windows(3)
  np.testing.assert_array_equal(ds.train_batch(3)["inputs"][:, 0], part * 1000 + starts)


def test_text_eval_windows_run_through_the_val_parts_in_order():
  # 2 windows of 9 tokens in part 0 (20 tokens), 3 in part 1 (27), 1 in part 2: need 4 * 1.
  ds = D.TextDataset(_parts([40]), _parts([20, 27, 9]), seq_len=8, batch_size=1, seed=0,
                     eval_batches=4)
  part, starts = ds.eval_windows()
  assert part.tolist() == [0, 0, 1, 1] and starts.tolist() == [0, 9, 0, 9]
  firsts = [int(b["inputs"][0, 0]) for b in ds.eval_batches()]
  assert firsts == [0, 9, 1000, 1009]
  assert ds.eval_batches()[3]["targets"][0].tolist() == list(range(1010, 1018))


def test_text_parts_processes_concatenate_to_global_batch_and_steps_are_pure():
  make = lambda **kw: D.TextDataset(_parts([300, 50, 120]), _parts([200, 150]), seq_len=8,
                                    batch_size=12, seed=4, eval_batches=3, **kw)
  full = make()
  later = full.train_batch(9)["inputs"]
  parts = [make(process_index=p, process_count=3) for p in range(3)]
  for step in (9, 0, 2):
    for key in ("inputs", "targets"):
      got = np.concatenate([p.train_batch(step)[key] for p in parts])
      np.testing.assert_array_equal(got, full.train_batch(step)[key])
  np.testing.assert_array_equal(full.train_batch(9)["inputs"], later)   # whatever came before
  assert not np.array_equal(full.train_batch(8)["inputs"], later)
  for i, batch in enumerate(full.eval_batches()):
    got = np.concatenate([p.eval_batches()[i]["targets"] for p in parts])
    np.testing.assert_array_equal(got, batch["targets"])


# --- images ----------------------------------------------------------------------------------


def test_image_split_ignores_seed_and_is_disjoint():
  images, labels = _images()
  a = D.ImageDataset(images, labels, batch_size=8, seed=0)
  b = D.ImageDataset(images, labels, batch_size=8, seed=3)
  np.testing.assert_array_equal(a.val_index, b.val_index)
  assert a.num_val == 20 and a.num_train == 80
  assert sorted(a.val_index.tolist() + a.train_index.tolist()) == list(range(100))
  assert a.tokens_per_example == 1


def test_image_stream_covers_each_train_example_once_per_epoch():
  images, labels = _images()
  ds = D.ImageDataset(images, labels, batch_size=8, seed=1)
  per_epoch = ds.num_train // 8   # 10 steps
  train_ids = set(ds.train_index.tolist())
  epochs = []
  for e in range(2):
    ids = np.concatenate([_ids(ds.train_batch(s)) for s in range(e * per_epoch,
                                                                 (e + 1) * per_epoch)])
    assert sorted(ids.tolist()) == sorted(train_ids)
    epochs.append(ids)
  assert not np.array_equal(epochs[0], epochs[1])   # reshuffled each epoch
  b = ds.train_batch(0)
  assert b["images"].shape == (8, 4, 4, 1) and b["images"].dtype == np.float32
  assert b["labels"].dtype == np.int32
  np.testing.assert_array_equal(b["labels"], _ids(b) % 10)


def test_image_batches_deterministic_and_straddle_epochs():
  images, labels = _images()
  ds = D.ImageDataset(images, labels, batch_size=24, seed=2)   # 80 train: batch 3 straddles
  np.testing.assert_array_equal(_ids(ds.train_batch(3)),
                                _ids(D.ImageDataset(images, labels, batch_size=24,
                                                    seed=2).train_batch(3)))
  assert not np.array_equal(_ids(ds.train_batch(0)), _ids(ds.train_batch(1)))
  other = D.ImageDataset(images, labels, batch_size=24, seed=3)
  assert not np.array_equal(_ids(ds.train_batch(0)), _ids(other.train_batch(0)))
  stream = np.concatenate([_ids(ds.train_batch(s)) for s in range(10)])   # 240 = 3 epochs
  for e in range(3):
    assert sorted(stream[e * 80:(e + 1) * 80].tolist()) == sorted(ds.train_index.tolist())


def test_image_two_processes_concatenate_to_global_batch():
  images, labels = _images()
  full = D.ImageDataset(images, labels, batch_size=12, seed=0)
  parts = [D.ImageDataset(images, labels, batch_size=12, seed=0, process_index=p,
                          process_count=2) for p in range(2)]
  for step in (0, 6):   # step 6 straddles epochs 0 and 1
    for key in ("images", "labels"):
      got = np.concatenate([p.train_batch(step)[key] for p in parts])
      np.testing.assert_array_equal(got, full.train_batch(step)[key])
  evals = [p.eval_batches() for p in parts]
  for i, batch in enumerate(full.eval_batches()):
    for key in ("images", "labels", "weights"):
      got = np.concatenate([e[i][key] for e in evals])
      np.testing.assert_array_equal(got, batch[key])


def test_image_eval_batches_cover_val_once_with_padding_weights():
  images, labels = _images()
  ds = D.ImageDataset(images, labels, batch_size=8, seed=0)   # 20 val -> 8 + 8 + 4 (+4 pad)
  batches = ds.eval_batches()
  assert len(batches) == 3
  for b in batches:
    assert set(b) == {"images", "labels", "weights"}
    assert b["images"].shape == (8, 4, 4, 1) and b["weights"].dtype == np.float32
  weights = np.concatenate([b["weights"] for b in batches])
  assert weights.sum() == ds.num_val
  np.testing.assert_array_equal(weights, [1] * 20 + [0] * 4)
  ids = np.concatenate([_ids(b) for b in batches])
  np.testing.assert_array_equal(ids[:20], ds.val_index)
  assert not batches[-1]["images"][4:].any() and not batches[-1]["labels"][4:].any()
  np.testing.assert_array_equal(_ids(ds.eval_batches()[1]), ids[8:16])


def test_image_size_errors():
  images, labels = _images(n=10)
  with pytest.raises(ConfigError, match=r"^config\.batch_size: "):
    D.ImageDataset(images, labels, batch_size=9, seed=0)
  with pytest.raises(ConfigError, match=r"^config\.data"):
    D.ImageDataset(images, labels, batch_size=2, seed=0, val_fraction=0.01)
  with pytest.raises(ConfigError, match=r"^config\.batch_size: .*not divisible"):
    D.ImageDataset(images, labels, batch_size=3, seed=0, process_count=2)


# --- build -----------------------------------------------------------------------------------


def test_build_gpt_pydoc_and_text_file(tmp_path):
  ds = D.build(D.DataSpec.from_config(_gpt_config()))
  assert isinstance(ds, D.TextDataset) and ds.train_batch(0)["inputs"].shape == (4, 32)
  assert len(ds.eval_batches()) == 2
  p = tmp_path / "t.txt"
  p.write_bytes(TEXT)
  ds = D.build(D.DataSpec.from_config(_gpt_config(name="text_file", path=str(p))), process_index=1,
              process_count=2)
  assert ds.train_batch(0)["inputs"].shape == (2, 32)
  assert ds.eval_batches()[0]["inputs"].shape == (2, 32)


def test_build_vit_digits_and_npy(tmp_path):
  pytest.importorskip("sklearn")
  ds = D.build(D.DataSpec.from_config(_vit_config()))
  assert isinstance(ds, D.ImageDataset)
  assert ds.num_val == round(1797 * 0.2)
  assert ds.train_batch(0)["images"].shape == (16, 8, 8, 1)
  images, labels = _images(n=40, h=6, w=6, c=3)
  np.save(tmp_path / "x.npy", images)
  np.save(tmp_path / "y.npy", labels)
  config = _vit_config(image_size=6, channels=3, name="npy", images=str(tmp_path / "x.npy"),
                       labels=str(tmp_path / "y.npy"))
  assert D.build(D.DataSpec.from_config(config)).train_batch(0)["images"].shape == (16, 6, 6, 3)


@pytest.mark.parametrize("config, process_count, pattern", [
    (_gpt_config(name="foo"), 1, r"config\.data\.name: 'foo' is not one of .*pydoc.*text_file"),
    (_vit_config(name="pydoc"), 1, r"config\.data\.name: 'pydoc' is not one of .*digits.*npy"),
    (_gpt_config(val_fraction=0.0), 1, r"config\.data\.val_fraction: "),
    (_gpt_config(val_fraction=1.5), 1, r"config\.data\.val_fraction: "),
    (_vit_config(val_fraction=1.0), 1, r"config\.data\.val_fraction: "),
    (_gpt_config(eval_batches=0), 1, r"config\.data\.eval_batches: "),
    (_gpt_config(), 3, r"config\.batch_size: "),
    (_vit_config(), 3, r"config\.batch_size: "),
    (_vit_config(image_size=28), 1, r"config\.model\.image_size: "),
    (_vit_config(channels=3), 1, r"config\.model\.channels: "),
    (_vit_config(num_classes=5), 1, r"config\.model\.num_classes: "),
])
def test_build_errors_name_their_field(config, process_count, pattern):
  if config.model.name == "vit" and config.data.name == "digits":
    pytest.importorskip("sklearn")
  with pytest.raises(ConfigError, match="^" + pattern):
    D.build(D.DataSpec.from_config(config), process_count=process_count)


def test_build_unknown_model():
  config = _gpt_config()
  config.model.name = "resnet"
  with pytest.raises(ConfigError, match=r"^config\.model\.name: 'resnet'"):
    D.DataSpec.from_config(config)


@pytest.fixture(scope="module")
def prepared_stdlib(tmp_path_factory):
  """A directory holding the token shards the full-size configs read (their documented
  command's output, `prepare.STDLIB_DIR` below it)."""
  root = tmp_path_factory.mktemp("prepared")
  cwd = os.getcwd()
  os.chdir(root)
  try:
    prepare.prepare(prepare.Request(prepare.STDLIB, prepare.STDLIB_DIR,
                                    vocab_size=prepare.STDLIB_VOCAB), say=lambda line: None)
  finally:
    os.chdir(cwd)
  return root


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "configs", "*.py"))),
                         ids=os.path.basename)
def test_build_the_default_config_of_every_config_file(path, request, monkeypatch):
  config = config_lib.load(path)   # no option after the colon: the full-size default
  if config.data.name == "digits":
    pytest.importorskip("sklearn")
  if config.data.name == "tokens":   # relative shard paths, prepared by the documented command
    monkeypatch.chdir(request.getfixturevalue("prepared_stdlib"))
  ds = D.build(config_lib.validate(config).data)
  assert len(ds.eval_batches()) >= 1
  assert len(ds.train_batch(0)) == 2
