"""Deterministic training data that needs no download.

Two kinds of data, both plain NumPy on the host:
  * token ids for a GPT, batched by `TextDataset`: the bytes of a text, for a byte-level GPT
    (`pydoc_corpus()`, the help text that ships with every Python, about 0.5 MB: enough for
    small models; `stdlib_corpus()`, the `.py` sources of this Python's standard library, about
    12 MB: enough for the default GPT's validation batches; or any file, `read_text_file`), or
    token shards on disk, memory-mapped (`semijax.train.tokens`), for a GPT of their vocabulary;
  * images for a ViT classifier: scikit-learn's bundled 8x8 digits (`digits()`) or a pair of
    `.npy` files (`load_npy_images`), batched by `ImageDataset`.

Determinism: a global training batch is a pure function of (seed, step), so a restarted or
re-sharded run sees exactly the same data. `batch_size` is always the GLOBAL batch; with
`process_count` processes, process p gets rows [p*local, (p+1)*local) of every global batch
(local = batch_size / process_count), so the processes' rows concatenated are the global batch.
Evaluation batches are fixed: the same on every call and for every seed.

`build(spec)` makes the dataset a `DataSpec` describes. Every check raises `ConfigError` with a
message that starts with the config field it is about, e.g. "config.data.path: no such file: ...".
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import os
import sysconfig

import numpy as np

from semijax.errors import ConfigError
from semijax.train import tokens as tokens_lib

TEXT_DATA = ("pydoc", "stdlib", "text_file", "tokens")
IMAGE_DATA = ("digits", "npy")
MODELS = {"gpt": TEXT_DATA, "llama": TEXT_DATA, "vit": IMAGE_DATA}

# --- sources --------------------------------------------------------------------------------


def pydoc_corpus() -> bytes:
  """The pydoc help topics of this Python (`pydoc_data.topics.topics`), UTF-8, sorted by name.

  Returns:
    b"\\n\\n".join of every topic's text, in sorted topic-name order (several hundred kB).
  """
  try:
    from pydoc_data import topics as pydoc_topics  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError(
        "config.data.name: 'pydoc' needs the standard-library module pydoc_data, which this "
        "Python lacks; use config.data.name = 'text_file'") from e
  topics = pydoc_topics.topics
  return b"\n\n".join(topics[k].encode("utf-8") for k in sorted(topics))


# Directories of the standard library that `stdlib_corpus` leaves out: tests and installed packages.
SKIPPED_SOURCE_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})


@functools.cache
def stdlib_corpus() -> bytes:
  """The `.py` sources of this Python's standard library (`python_sources` of its directory).

  Read once per process (about 12 MB for CPython 3.11, in a fraction of a second); the same bytes
  for the same Python installation.
  """
  root = stdlib_root()
  data = python_sources(root)
  if not data:
    raise ConfigError(f"config.data.name: 'stdlib' found no .py files in {root}; use 'pydoc' or "
                      "'text_file'")
  return data


def stdlib_root() -> str:
  """This Python's standard library directory."""
  return sysconfig.get_paths()["stdlib"]


def source_files(root: str, suffix: str = "", skip=frozenset(), avoid: str = "",
                 hidden: bool = True) -> list[str]:
  """The regular files under `root` whose names end in `suffix`, in a fixed order.

  Each directory's files come in sorted name order, then its subdirectories in sorted order
  (`os.walk`, top-down). Directories named in `skip` and the directory `avoid` (with what is
  under it) are left out, and so are names that start with "." unless `hidden`; `isfile` leaves
  out fifos and dead links.
  """
  avoid = os.path.realpath(avoid) if avoid else ""
  shown = lambda name: hidden or not name.startswith(".")
  found = []
  for directory, subdirs, files in os.walk(root):
    subdirs[:] = sorted(d for d in subdirs if d not in skip and shown(d)
                        and not (avoid and os.path.realpath(os.path.join(directory, d)) == avoid))
    found += [os.path.join(directory, name) for name in sorted(files)
              if name.endswith(suffix) and shown(name)
              and os.path.isfile(os.path.join(directory, name))]
  return found


def python_sources(root: str) -> bytes:
  """The `.py` files under `root` (`source_files`, without the SKIPPED_SOURCE_DIRS), joined by
  blank lines; a file that cannot be read is left out."""
  parts = []
  for path in source_files(root, ".py", SKIPPED_SOURCE_DIRS):
    try:
      with open(path, "rb") as f:
        parts.append(f.read())
    except OSError:
      continue
  return b"\n\n".join(parts)


def read_text_file(path: str) -> bytes:
  """The bytes of the file at `path`; refuses a missing, unreadable or empty file."""
  try:
    with open(path, "rb") as f:
      data = f.read()
  except FileNotFoundError as e:
    raise ConfigError(f"config.data.path: no such file: {path}") from e
  except OSError as e:
    raise ConfigError(f"config.data.path: cannot read {path}: {e.strerror or e}") from e
  if not data:
    raise ConfigError(f"config.data.path: {path} is empty")
  return data


def digits() -> tuple[np.ndarray, np.ndarray]:
  """scikit-learn's bundled 8x8 handwritten digits (no download).

  Returns:
    images: float32 [1797, 8, 8, 1] in [0, 1] (pixel counts 0..16 divided by 16).
    labels: int32 [1797], the digit 0..9.
  """
  try:
    from sklearn import datasets  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise ConfigError("config.data.name: 'digits' needs scikit-learn; "
                      "pip install 'semijax[digits]'") from e
  d = datasets.load_digits()
  images = (np.asarray(d.images, np.float32) / 16.0)[..., None]
  return images, np.asarray(d.target, np.int32)


def _load_npy(path: str, field: str) -> np.ndarray:
  """np.load without pickles; any failure becomes a ConfigError naming `field`."""
  try:
    return np.load(path, allow_pickle=False)
  except FileNotFoundError as e:
    raise ConfigError(f"{field}: no such file: {path}") from e
  except (OSError, ValueError) as e:
    raise ConfigError(f"{field}: cannot read {path} as a .npy array: {e}") from e


def load_npy_images(images_path: str, labels_path: str) -> tuple[np.ndarray, np.ndarray]:
  """Images and labels from two `.npy` files.

  Args:
    images_path: a real-valued array [N, H, W] or [N, H, W, C] (config.data.images).
    labels_path: an integer array [N] (config.data.labels).

  Returns:
    images: float32 [N, H, W, C] (C = 1 added for 3-D input), values unchanged.
    labels: int32 [N].
  """
  images = _load_npy(images_path, "config.data.images")
  labels = _load_npy(labels_path, "config.data.labels")
  if images.ndim not in (3, 4):
    raise ConfigError(f"config.data.images: {images_path} has shape {images.shape}; "
                      "need [N, H, W] or [N, H, W, C]")
  if not (np.issubdtype(images.dtype, np.integer) or np.issubdtype(images.dtype, np.floating)
          or images.dtype == np.bool_):
    raise ConfigError(f"config.data.images: {images_path} has dtype {images.dtype}; "
                      "need a real (integer or floating) dtype")
  if images.shape[0] < 1:
    raise ConfigError(f"config.data.images: {images_path} holds no images")
  if labels.ndim != 1:
    raise ConfigError(f"config.data.labels: {labels_path} has shape {labels.shape}; need [N]")
  if not np.issubdtype(labels.dtype, np.integer):
    raise ConfigError(f"config.data.labels: {labels_path} has dtype {labels.dtype}; "
                      "need an integer dtype")
  if len(labels) != len(images):
    raise ConfigError(f"config.data.labels: {len(labels)} labels in {labels_path}, but "
                      f"{len(images)} images in config.data.images")
  info = np.iinfo(np.int32)
  if labels.min() < info.min or labels.max() > info.max:
    raise ConfigError(f"config.data.labels: values in {labels_path} do not fit in int32")
  if images.ndim == 3:
    images = images[..., None]
  return images.astype(np.float32), labels.astype(np.int32)


# --- shared checks --------------------------------------------------------------------------


def _check_int(value, field: str, minimum: int) -> int:
  """`value` as an int >= `minimum`, else a ConfigError naming `field`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ConfigError(f"{field}: need an integer >= {minimum}, got {value!r}")
  return int(value)


def _check_fraction(value, field: str = "config.data.val_fraction") -> float:
  """`value` as a float strictly inside (0, 1), else a ConfigError naming `field`."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value < 1:
    raise ConfigError(f"{field}: need a number strictly between 0 and 1, got {value!r}")
  return float(value)


def _local_rows(batch_size: int, process_index: int, process_count: int) -> slice:
  """The rows of every global batch that process `process_index` gets."""
  batch_size = _check_int(batch_size, "config.batch_size", 1)
  process_count = _check_int(process_count, "process_count", 1)
  if not isinstance(process_index, numbers.Integral) or not 0 <= process_index < process_count:
    raise ConfigError(f"process_index: {process_index!r} is outside [0, {process_count})")
  if batch_size % process_count:
    raise ConfigError(f"config.batch_size: the global batch {batch_size} is not divisible by "
                      f"the {process_count} processes")
  local = batch_size // process_count
  return slice(process_index * local, (process_index + 1) * local)


def _check_step(step) -> int:
  if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
    raise ValueError(f"step: need an integer >= 0, got {step!r}")
  return int(step)


# --- text -----------------------------------------------------------------------------------


def split_tail(parts, val_fraction: float) -> tuple[tuple, tuple]:
  """Token parts (1-D arrays, in order) -> (train parts, val parts): the last round(total *
  val_fraction) tokens of their concatenation validate, the rest train. Parts are sliced, never
  copied (a memmap stays a memmap); empty slices are dropped."""
  total = sum(len(p) for p in parts)
  left = total - round(total * _check_fraction(val_fraction))   # training tokens still to take
  train, val = [], []
  for part in parts:
    at = min(left, len(part))
    left -= at
    train.append(part[:at])
    val.append(part[at:])
  return tuple(p for p in train if len(p)), tuple(p for p in val if len(p))


class TextDataset:
  """Language-model batches from token ids held in parts (a text's bytes, token shards, ...).

  A window is seq_len + 1 consecutive tokens of one part; it never straddles two. Training batch
  `step` holds `batch_size` windows drawn uniformly from all the training windows (so a part is
  chosen in proportion to its windows), by np.random.default_rng([seed, step]). Evaluation uses
  `eval_batches` fixed batches of non-overlapping consecutive windows, the val parts in order.
  Batches are {"inputs": int32 [local, seq_len], "targets": int32 [local, seq_len]} with
  targets = inputs shifted left by one token.

  Args:
    train, val: the training and validation tokens: sequences of 1-D arrays of any integer dtype
      (uint8 bytes, uint16 / uint32 `np.memmap` shards, ...); only the windows a batch takes
      are read. `split_tail` makes both from one sequence.
  """

  def __init__(self, train, val, *, seq_len: int, batch_size: int, seed: int,
               eval_batches: int = 4, process_index: int = 0, process_count: int = 1):
    self.seq_len = _check_int(seq_len, "config.model.seq_len", 1)
    self.batch_size = _check_int(batch_size, "config.batch_size", 1)
    self.seed = _check_int(seed, "config.seed", 0)
    self.num_eval_batches = _check_int(eval_batches, "config.data.eval_batches", 1)
    self._rows = _local_rows(batch_size, process_index, process_count)
    self.train = tuple(train)   # 1-D integer arrays
    self.val = tuple(val)
    windows = [max(0, len(p) - self.seq_len) for p in self.train]
    self._first_window = np.cumsum([0] + windows)   # int64 [len(train) + 1]
    self._check_sizes()

  def _check_sizes(self):
    longest = max((len(p) for p in self.train), default=0)
    need = self.seq_len + 2
    if longest < need:
      raise ConfigError(
          f"config.data: the training part has {longest} tokens in its longest piece (a text "
          f"or one shard), but seq_len + 2 = {need} are needed ({need - longest} short); a "
          "window lies inside one piece: use more text, longer shards or a shorter "
          "config.model.seq_len")
    width, need = self.seq_len + 1, self.num_eval_batches * self.batch_size
    have = sum(len(p) // width for p in self.val)
    if have < need:
      raise ConfigError(
          f"config.data: the validation part holds {have} windows of seq_len + 1 = {width} "
          f"tokens, but eval_batches * batch_size = {self.num_eval_batches} * {self.batch_size} "
          f"= {need} are needed ({need - have} short); use more text, a larger "
          "config.data.val_fraction, more config.data.val_path shards or fewer "
          "config.data.eval_batches")

  @property
  def tokens_per_example(self) -> int:
    return self.seq_len

  @property
  def num_train_tokens(self) -> int:
    return sum(len(p) for p in self.train)

  @property
  def steps_per_epoch(self) -> int:
    """Global batches that together hold about as many tokens as the training part."""
    return max(1, math.ceil(self.num_train_tokens / (self.batch_size * self.seq_len)))

  @property
  def local_batch_size(self) -> int:
    return self._rows.stop - self._rows.start

  def _windows(self, parts, which: np.ndarray, starts: np.ndarray) -> dict[str, np.ndarray]:
    """Window b = parts[which[b]][starts[b]:][:seq_len + 1], for which, starts: int [B] ->
    {"inputs", "targets"}: int32 [B, seq_len]."""
    offsets = np.arange(self.seq_len + 1)
    windows = np.empty((len(which), self.seq_len + 1), np.int32)
    for part in np.unique(which):
      rows = which == part
      windows[rows] = parts[part][starts[rows, None] + offsets]
    return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

  def global_windows(self, step: int) -> tuple[np.ndarray, np.ndarray]:
    """(part, start), int64 [batch_size] each: window b of global batch `step` starts at
    train[part[b]][start[b]]."""
    rng = np.random.default_rng([self.seed, _check_step(step)])
    index = rng.integers(0, self._first_window[-1], size=self.batch_size)
    part = np.searchsorted(self._first_window, index, side="right") - 1
    return part, index - self._first_window[part]

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global training batch `step` (a pure function of seed, step)."""
    part, start = self.global_windows(step)
    return self._windows(self.train, part[self._rows], start[self._rows])

  def eval_windows(self) -> tuple[np.ndarray, np.ndarray]:
    """(part, start), int64 [eval_batches * batch_size] each: the evaluation windows in order,
    the first non-overlapping windows of val[0], then of val[1], ..."""
    width, need = self.seq_len + 1, self.num_eval_batches * self.batch_size
    which, starts = [], []
    for i, part in enumerate(self.val):
      count = min(len(part) // width, need)
      which.append(np.full(count, i))
      starts.append(np.arange(count) * width)
      need -= count
    return np.concatenate(which), np.concatenate(starts)

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """The fixed evaluation batches: this process's rows of each, in order."""
    part, start = (a.reshape(self.num_eval_batches, self.batch_size) for a in self.eval_windows())
    return [self._windows(self.val, p[self._rows], s[self._rows]) for p, s in zip(part, start)]


# --- images ---------------------------------------------------------------------------------


class ImageDataset:
  """Image classification batches.

  The split ignores the seed: examples are permuted with np.random.default_rng(0); the first
  round(N * val_fraction) validate, the rest train. Training is an endless stream whose epoch e
  visits the train examples in the order np.random.default_rng([seed, e]).permutation(n_train);
  global batch `step` is stream positions [step * B, (step + 1) * B). Training batches are
  {"images": float32 [local, H, W, C], "labels": int32 [local]}; eval batches add
  "weights": float32 [local] (0 on padding).
  """

  def __init__(self, images: np.ndarray, labels: np.ndarray, *, batch_size: int, seed: int,
               val_fraction: float = 0.2, process_index: int = 0, process_count: int = 1):
    self.batch_size = _check_int(batch_size, "config.batch_size", 1)
    self.seed = _check_int(seed, "config.seed", 0)
    val_fraction = _check_fraction(val_fraction)
    self._rows = _local_rows(batch_size, process_index, process_count)
    self.images = np.asarray(images, np.float32)
    self.labels = np.asarray(labels, np.int32)
    if self.images.ndim != 4:
      raise ConfigError(f"config.data: images have shape {self.images.shape}; need [N, H, W, C]")
    if self.labels.shape != self.images.shape[:1]:
      raise ConfigError(f"config.data: labels have shape {self.labels.shape}; need "
                        f"[{len(self.images)}], one per image")
    order = np.random.default_rng(0).permutation(len(self.images))
    num_val = round(len(self.images) * val_fraction)
    self.val_index = order[:num_val]     # int64 [n_val], indices into images
    self.train_index = order[num_val:]   # int64 [n_train]
    if num_val < 1:
      raise ConfigError(f"config.data.val_fraction: {val_fraction} of {len(self.images)} "
                        "examples leaves no validation example")
    if len(self.train_index) < self.batch_size:
      raise ConfigError(
          f"config.batch_size: {self.batch_size} is more than the {len(self.train_index)} "
          f"training examples in config.data ({self.batch_size - len(self.train_index)} short)")
    self._epoch_cache: tuple[int, np.ndarray] | None = None

  @property
  def tokens_per_example(self) -> int:
    return 1

  @property
  def local_batch_size(self) -> int:
    return self._rows.stop - self._rows.start

  @property
  def num_train(self) -> int:
    return len(self.train_index)

  @property
  def steps_per_epoch(self) -> int:
    """Global batches per pass over the training images."""
    return max(1, math.ceil(self.num_train / self.batch_size))

  @property
  def num_val(self) -> int:
    return len(self.val_index)

  def epoch_order(self, epoch: int) -> np.ndarray:
    """int64 [n_train]: the order (positions in the train part) that epoch `epoch` visits."""
    if self._epoch_cache is None or self._epoch_cache[0] != epoch:
      perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_train)
      self._epoch_cache = (epoch, perm)
    return self._epoch_cache[1]

  def train_positions(self, step: int) -> np.ndarray:
    """int64 [local]: the train-part positions of this process's rows of global batch `step`."""
    pos = _check_step(step) * self.batch_size + np.arange(self._rows.start, self._rows.stop)
    epoch, offset = np.divmod(pos, self.num_train)
    out = np.empty_like(pos)
    for e in np.unique(epoch):
      at = epoch == e
      out[at] = self.epoch_order(int(e))[offset[at]]
    return out

  def train_batch(self, step: int) -> dict[str, np.ndarray]:
    """This process's rows of global training batch `step` (a pure function of seed, step)."""
    index = self.train_index[self.train_positions(step)]
    return {"images": self.images[index], "labels": self.labels[index]}

  def eval_batches(self) -> list[dict[str, np.ndarray]]:
    """The whole val set in order, in global batches of batch_size; this process's rows of each.

    The last global batch is padded with zero images and label 0; every batch carries
    "weights": float32 [local], 1 on real examples and 0 on padding.
    """
    b = self.batch_size
    num_batches = math.ceil(self.num_val / b)
    pad = num_batches * b - self.num_val
    shape = self.images.shape[1:]
    images = np.concatenate([self.images[self.val_index], np.zeros((pad, *shape), np.float32)])
    labels = np.concatenate([self.labels[self.val_index], np.zeros(pad, np.int32)])
    weights = np.concatenate([np.ones(self.num_val, np.float32), np.zeros(pad, np.float32)])
    out = []
    for i in range(num_batches):
      rows = slice(i * b + self._rows.start, i * b + self._rows.stop)
      out.append({"images": images[rows], "labels": labels[rows], "weights": weights[rows]})
    return out


# --- from a config --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DataSpec:
  """What a run's data set is (`config.data` with the model fields and batch it depends on).

  Attributes:
    model: "gpt" or "llama" (text) or "vit" (images): which data sets apply (`MODELS`).
    name: the data set (`TEXT_DATA` or `IMAGE_DATA`).
    batch_size: the GLOBAL batch; seed: data order.
    val_fraction: held-out share for validation.
    path: "text_file": the file; "tokens": a path or glob of token shards (`tokens`).
    val_path: "tokens": the validation shards; "" = the last val_fraction of the path's.
    images, labels: "npy": the two arrays.
    eval_batches: text: validation batches per evaluation.
    seq_len, vocab_size: text: tokens per example and the model's vocabulary (token shards must
      match it). image_size, channels, num_classes: images: what the model expects (the data
      must match).
  """

  model: str
  name: str
  batch_size: int
  seed: int
  val_fraction: float = 0.1
  path: str = ""
  val_path: str = ""
  images: str = ""
  labels: str = ""
  eval_batches: int = 4
  seq_len: int = 0
  vocab_size: int = 0
  image_size: int = 0
  channels: int = 0
  num_classes: int = 0

  @classmethod
  def from_config(cls, config) -> "DataSpec":
    """Reads `config.data`, the model's data-related fields, `batch_size` and `seed` of a
    ConfigDict (at the config boundary); checks the name, the held-out fraction and that only
    token shards take a val_path. The files are read by `build`."""
    model = config.model.name
    if model not in MODELS:
      raise ConfigError(f"config.model.name: {model!r} is not one of {tuple(MODELS)}")
    d, m = config.data, config.model
    _check_name(model, d.name)
    get = lambda node, key, default: node[key] if key in node else default
    val_path = get(d, "val_path", "")
    if val_path and d.name != "tokens":
      raise ConfigError(f"config.data.val_path: {val_path!r} is for data.name 'tokens' only, "
                        f"not {d.name!r}")
    return cls(model, d.name, config.batch_size, config.seed, _check_fraction(d.val_fraction),
               path=get(d, "path", ""), val_path=val_path, images=get(d, "images", ""),
               labels=get(d, "labels", ""), eval_batches=get(d, "eval_batches", 4),
               seq_len=get(m, "seq_len", 0), vocab_size=get(m, "vocab_size", 0),
               image_size=get(m, "image_size", 0), channels=get(m, "channels", 0),
               num_classes=get(m, "num_classes", 0))


def _check_name(model: str, name: str) -> None:
  valid = MODELS[model]
  if name not in valid:
    raise ConfigError(f"config.data.name: {name!r} is not one of {valid} "
                      f"(the datasets for model {model!r})")


def _token_parts(spec: DataSpec) -> tuple[tuple, tuple]:
  """(train, val) memmaps of the token shards `spec` names, checked against the model."""
  train = tokens_lib.open_shards(spec.path, "config.data.path")
  tokens_lib.check_vocab_size(train, spec.vocab_size)
  if not spec.val_path:
    return split_tail(train.tokens, spec.val_fraction)
  val = tokens_lib.open_shards(spec.val_path, "config.data.val_path")
  tokens_lib.check_same_vocabulary(val.header, train.header, f"config.data.val_path: "
                                   f"{val.header_file}", train.header_file)
  return train.tokens, val.tokens


def _build_text(spec: DataSpec, process_index: int, process_count: int) -> TextDataset:
  sources = {"pydoc": pydoc_corpus, "stdlib": stdlib_corpus,
             "text_file": lambda: read_text_file(spec.path)}
  if spec.name == "tokens":
    train, val = _token_parts(spec)
  else:
    train, val = split_tail([np.frombuffer(sources[spec.name](), np.uint8)], spec.val_fraction)
  return TextDataset(train, val, seq_len=spec.seq_len, batch_size=spec.batch_size,
                     seed=spec.seed, eval_batches=spec.eval_batches,
                     process_index=process_index, process_count=process_count)


def _check_images_match_model(images: np.ndarray, labels: np.ndarray, spec: DataSpec) -> None:
  """Refuses images [N, H, W, C] / labels [N] that do not fit the model."""
  size = _check_int(spec.image_size, "config.model.image_size", 1)
  channels = _check_int(spec.channels, "config.model.channels", 1)
  num_classes = _check_int(spec.num_classes, "config.model.num_classes", 1)
  _, h, w, c = images.shape
  if h != size or w != size:
    raise ConfigError(f"config.model.image_size: the images are {h}x{w}, but "
                      f"config.model.image_size is {size}")
  if c != channels:
    raise ConfigError(f"config.model.channels: the images have {c} channels, but "
                      f"config.model.channels is {channels}")
  lo, hi = int(labels.min()), int(labels.max())
  if lo < 0 or hi >= num_classes:
    raise ConfigError(f"config.model.num_classes: labels span [{lo}, {hi}], outside "
                      f"[0, {num_classes})")


def _build_images(spec: DataSpec, process_index: int, process_count: int) -> ImageDataset:
  if spec.name == "digits":
    images, labels = digits()
  else:
    images, labels = load_npy_images(spec.images, spec.labels)
  _check_images_match_model(images, labels, spec)
  return ImageDataset(images, labels, batch_size=spec.batch_size, seed=spec.seed,
                      val_fraction=spec.val_fraction,
                      process_index=process_index, process_count=process_count)


def build(spec: DataSpec, process_index: int = 0, process_count: int = 1):
  """The dataset `spec` describes: a TextDataset for a language model ("gpt", "llama"), an
  ImageDataset for "vit".

  Args:
    spec: the run's `DataSpec` (`config.validate` builds it; `DataSpec.from_config` too).
    process_index: this process, in [0, process_count).
    process_count: the processes sharing each global batch (must divide the batch size).

  Returns:
    The dataset, with this process's rows of every batch.
  """
  _local_rows(spec.batch_size, process_index, process_count)
  if MODELS[spec.model] is TEXT_DATA:
    return _build_text(spec, process_index, process_count)
  return _build_images(spec, process_index, process_count)
