"""Token shards from text: a byte-level BPE tokenizer, trained here or loaded, and its shards.

`experiments/prepare_data.py` is the command; `prepare(request)` does the work:

  input      "stdlib" (the `.py` files of this Python's standard library, the files that
             `data.stdlib_corpus` joins), a text file, or a directory: its files, recursively,
             each directory's files in sorted name order and then its subdirectories in sorted
             order (`data.source_files`); names that start with "." (.git,
             .venv) and the output directory are skipped. Each file is one document, read as
             UTF-8 (bytes that are not UTF-8 are replaced by U+FFFD).
  tokenizer  trained here (tokenizers' BpeTrainer over its ByteLevel pre-tokenizer: the 256
             byte symbols, the end token `EOT` = id 0, then merges up to `vocab_size`), or loaded
             from a tokenizer.json that holds the end token. Either way it is saved beside the
             shards as `tokenizer.json`.
  stream     every document's tokens followed by the end token, the documents in input order;
             a literal "<|endoftext|>" in the text is encoded as text, never as the end token.
  output     `val_NNN.bin`: the last round(N * val_fraction) tokens of the stream (the cut that
             `config.data.val_fraction` makes in memory; a document may straddle it);
             `train_NNN.bin`: the rest; each cut into the fewest near-equal shards of at most
             `shard_tokens` tokens, each with its `.json` header (`semijax.train.tokens`), whose
             `tokenizer` is "tokenizer.json" and `eot` the end token's id.

Determinism: the same input and flags write the same bytes. The trainer has no randomness: its
merges are chosen by pair count, ties broken by the pair's ids, and tokenizers serializes the
vocabulary and merges in id order; its threads (TOKENIZERS_PARALLELISM, RAYON_NUM_THREADS) only
split the counting, so the tokenizer and the shards do not depend on them (tests check both).

Safety: every argument is checked (`check`) before any file is read, an error naming its flag
("--vocab_size: ..."). The outputs are written to a temporary directory inside `out_dir` and
renamed into place at the end; shards of an earlier run that this one does not write are then
removed. A run that fails or is interrupted leaves `out_dir` as it was.

The `tokenizers` package (the `data` extra) is imported only here, when needed.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import re
import shutil
import sys
import time
from typing import Callable, Iterator

import numpy as np

from semijax.errors import InputError
from semijax.train import data as data_lib
from semijax.train import tokens as tokens_lib

EOT = "<|endoftext|>"
STDLIB = "stdlib"
TOKENIZER_FILE = "tokenizer.json"
DEFAULT_VOCAB = 4096
DEFAULT_SHARD_TOKENS = 100_000_000
MIN_VOCAB = 257                    # the 256 byte symbols and the end token
PIECE_CHARS = 1 << 20              # documents are encoded in pieces of about this many characters,
BATCH_CHARS = 1 << 22              # in batches of about this many
OUTPUT = re.compile(r"^(train|val)_\d+\.bin(\.json)?$")
# The configs' tokenized standard library (configs/gpt_tiny.py, configs/gpt_gpu.py), which
# `python experiments/prepare_data.py --input=stdlib --out_dir=data/stdlib_bpe4k
# --vocab_size=4096` writes (relative to the directory a run starts in: the repository root).
STDLIB_DIR = "data/stdlib_bpe4k"
STDLIB_VOCAB = 4096


@dataclasses.dataclass(frozen=True)
class Request:
  """What to prepare (the flags of experiments/prepare_data.py).

  Attributes:
    input: "stdlib", a text file or a directory of text files.
    out_dir: where the shards and tokenizer.json go (created if missing).
    vocab_size: the vocabulary to train; None: DEFAULT_VOCAB, or the loaded tokenizer's.
    tokenizer: a tokenizer.json to load instead of training one; "" = train.
    val_fraction: the share of the stream's tokens, at its end, that validates.
    shard_tokens: the most tokens in one shard.
    eot_token: the special token that ends every document.
  """

  input: str
  out_dir: str
  vocab_size: int | None = None
  tokenizer: str = ""
  val_fraction: float = 0.1
  shard_tokens: int = DEFAULT_SHARD_TOKENS
  eot_token: str = EOT


@dataclasses.dataclass(frozen=True)
class Summary:
  """What `prepare` wrote.

  Attributes:
    out_dir: the directory. files: {file name: bytes on disk} of every file written.
    documents, text_bytes: the input's files and their size.
    vocab_size: the shards' vocabulary; learned: the tokenizer's own size (<= vocab_size).
    eot: the end token's id. train_tokens, val_tokens: the stream's two parts.
    disk_bytes: the files' total size. seconds: {phase: seconds} (tokenizer, encode, write).
  """

  out_dir: str
  files: dict
  documents: int
  text_bytes: int
  vocab_size: int
  learned: int
  eot: int
  train_tokens: int
  val_tokens: int
  disk_bytes: int
  seconds: dict


# --- the tokenizers package -----------------------------------------------------------------


def tokenizers_module():
  """The `tokenizers` package, or an InputError that names the extra that installs it."""
  try:
    import tokenizers  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise InputError("tokenizers: not installed; preparing token shards needs it: pip install "
                     "-e '.[data]' (or pip install 'tokenizers>=0.19')") from None
  return tokenizers


# --- checking the request -------------------------------------------------------------------


def _integer(value, flag: str, lo: int, hi: int) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not lo <= value <= hi:
    raise InputError(f"{flag}: need an integer in [{lo}, {hi}], got {value!r}")
  return int(value)


def _check_out_dir(out_dir: str) -> None:
  """Refuses an out_dir that is a file or that could not be created or written."""
  if not isinstance(out_dir, str) or not out_dir:
    raise InputError("--out_dir: need a directory for the shards, got ''")
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise InputError(f"--out_dir: {out_dir} is a file, not a directory")
  existing = os.path.abspath(out_dir)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing) or not os.access(existing, os.W_OK | os.X_OK):
    raise InputError(f"--out_dir: cannot write in {existing}")


def _check_tokenizer(request: Request):
  """The loaded tokenizer of `request` (None when one is to be trained), checked."""
  if not request.tokenizer:
    return None
  if request.vocab_size is not None:
    raise InputError(f"--vocab_size: {request.vocab_size} given with --tokenizer, whose "
                     "vocabulary sets it; leave one out")
  try:
    tokenizer = tokenizers_module().Tokenizer.from_file(request.tokenizer)
  except Exception as e:  # noqa: BLE001  (tokenizers raises plain Exception on a bad file)
    reason = "no such file" if not os.path.isfile(request.tokenizer) else str(e).splitlines()[0]
    raise InputError(f"--tokenizer: cannot load {request.tokenizer}: {reason}") from None
  if tokenizer.token_to_id(request.eot_token) is None:
    raise InputError(f"--tokenizer: {request.tokenizer} has no {request.eot_token!r} token "
                     "(--eot_token names the one that ends documents)")
  return tokenizer


def check(request: Request) -> tuple[Request, tuple[str, ...], object]:
  """Checks `request` before any work.

  Returns:
    The request with vocab_size set, its input files in order, and the loaded tokenizer (None
    when one is to be trained).
  Raises:
    InputError whose message starts with the flag it is about.
  """
  tokenizers_module()
  if not isinstance(request.eot_token, str) or not request.eot_token:
    raise InputError(f"--eot_token: need a non-empty string, got {request.eot_token!r}")
  vf = request.val_fraction
  if isinstance(vf, bool) or not isinstance(vf, numbers.Real) or not 0 < vf < 1:
    raise InputError(f"--val_fraction: need a number strictly between 0 and 1, got {vf!r}")
  _integer(request.shard_tokens, "--shard_tokens", 1, 2**40)
  if request.vocab_size is not None:
    _integer(request.vocab_size, "--vocab_size", MIN_VOCAB, tokens_lib.MAX_VOCAB)
  _check_out_dir(request.out_dir)
  files = input_files(request.input, request.out_dir)
  tokenizer = _check_tokenizer(request)
  vocab = tokenizer.get_vocab_size() if tokenizer else request.vocab_size or DEFAULT_VOCAB
  return dataclasses.replace(request, vocab_size=vocab), files, tokenizer


# --- input ----------------------------------------------------------------------------------


def input_files(source: str, out_dir: str = "") -> tuple[str, ...]:
  """The documents' files of `source` ("stdlib", a file or a directory), in order."""
  if source == STDLIB:
    files = data_lib.source_files(data_lib.stdlib_root(), ".py", data_lib.SKIPPED_SOURCE_DIRS)
  elif not isinstance(source, str) or not source:
    raise InputError("--input: need 'stdlib', a text file or a directory, got ''")
  elif os.path.isfile(source):
    files = [source]
  elif os.path.isdir(source) and os.path.realpath(source) == os.path.realpath(out_dir):
    raise InputError(f"--input: {source} is the --out_dir; give the text's directory")
  elif os.path.isdir(source):
    files = data_lib.source_files(source, avoid=out_dir, hidden=False)
  else:
    raise InputError(f"--input: no such file or directory: {source} (or 'stdlib' for the "
                     "standard library's sources)")
  unreadable = [f for f in files if not os.access(f, os.R_OK)]
  if unreadable:
    raise InputError(f"--input: cannot read {unreadable[0]}")
  if not sum(os.path.getsize(f) for f in files):
    raise InputError(f"--input: {source} holds no text ({_count(len(files), 'empty file')})")
  return tuple(files)


def _count(n: int, noun: str) -> str:
  """"1 file", "2 files"."""
  return f"{n:,} {noun}" + ("" if n == 1 else "s")


def read_document(path: str) -> str:
  """The text of the file at `path`, decoded as UTF-8 (undecodable bytes become U+FFFD)."""
  with open(path, "rb") as f:
    return f.read().decode("utf-8", errors="replace")


def pieces(text: str, size: int = PIECE_CHARS) -> Iterator[str]:
  """`text` in consecutive pieces of about `size` characters, each but the last ending just
  after a newline where there is one (so that a long file is encoded a piece at a time)."""
  start = 0
  while start < len(text):
    stop = start + size
    if stop < len(text):
      newline = text.rfind("\n", start, stop)
      stop = newline + 1 if newline >= start else stop
    yield text[start:stop]
    start = stop


# --- the tokenizer --------------------------------------------------------------------------


def new_tokenizer():
  """An untrained byte-level BPE tokenizer (the pre-tokenizer and decoder of GPT-2's)."""
  tk = tokenizers_module()
  tokenizer = tk.Tokenizer(tk.models.BPE())
  tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = tk.decoders.ByteLevel()
  return tokenizer


def train_tokenizer(texts, vocab_size: int, eot_token: str = EOT):
  """A byte-level BPE tokenizer trained on the strings `texts` yields: id 0 is `eot_token`,
  then the 256 byte symbols, then merges until `vocab_size` tokens (fewer if the text runs out
  of pairs). Deterministic (module doc)."""
  tk = tokenizers_module()
  tokenizer = new_tokenizer()
  trainer = tk.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[eot_token], show_progress=False,
      initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
  tokenizer.train_from_iterator(texts, trainer)
  return tokenizer


def _documents_text(files, on_bytes: Callable[[int], None]) -> Iterator[str]:
  """The pieces of every file's text, in order; calls on_bytes(file size) after each file."""
  for path in files:
    yield from pieces(read_document(path))
    on_bytes(os.path.getsize(path))


def _file_batches(files, chars: int = BATCH_CHARS) -> Iterator[list[tuple[list[str], int]]]:
  """Consecutive files as batches of (the file's pieces, its size in bytes), each batch about
  `chars` characters or one file (encoded together, on tokenizers' threads)."""
  batch, size = [], 0
  for path in files:
    texts = list(pieces(read_document(path)))
    batch.append((texts, os.path.getsize(path)))
    size += sum(len(t) for t in texts)
    if size >= chars:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


def encode(tokenizer, files, eot: int, dtype, on_bytes: Callable[[int], None]) -> np.ndarray:
  """The stream: each file's tokens followed by `eot`, as one 1-D array of `dtype`."""
  tokenizer.encode_special_tokens = True   # the end token's text in a file is text
  parts, end = [], np.asarray([eot], dtype)
  for batch in _file_batches(files):
    encodings = iter(tokenizer.encode_batch([t for texts, _ in batch for t in texts]))
    for texts, nbytes in batch:
      parts += [np.asarray(next(encodings).ids, dtype) for _ in texts] + [end]
      on_bytes(nbytes)
  return np.concatenate(parts)


# --- output ---------------------------------------------------------------------------------


def cut(tokens: np.ndarray, val_fraction: float, shard_tokens: int) -> dict[str, np.ndarray]:
  """The shards of the stream `tokens`: {"train_000.bin": ..., "val_000.bin": ...} (module doc).

  Refuses, naming --val_fraction, a cut that leaves either part empty."""
  train, val = data_lib.split_tail([tokens], val_fraction)
  if not train or not val:
    raise InputError(f"--val_fraction: {val_fraction} of {len(tokens)} tokens leaves no "
                     f"{'training' if not train else 'validation'} token")
  out = {}
  for kind, (part,) in (("train", train), ("val", val)):
    count = -(-len(part) // shard_tokens)
    width = max(3, len(str(count - 1)))
    for i, shard in enumerate(np.array_split(part, count)):
      out[f"{kind}_{i:0{width}d}.bin"] = shard
  return out


def write_outputs(out_dir: str, shards: dict, tokenizer_json: bytes, *, vocab_size: int,
                  eot: int) -> dict:
  """Writes `shards` (name -> tokens) with their headers and tokenizer.json into `out_dir`.

  Everything goes to a temporary directory inside out_dir first and is renamed into place at
  the end; shards of an earlier run that are not in `shards` are then removed.

  Returns:
    {file name: bytes on disk} of every file written.
  """
  os.makedirs(out_dir, exist_ok=True)
  tmp = os.path.join(out_dir, f".prepare-tmp{os.getpid()}")
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  try:
    for name, tokens in shards.items():
      tokens_lib.write_shard(os.path.join(tmp, name), tokens, vocab_size=vocab_size,
                             tokenizer=TOKENIZER_FILE, eot=eot)
    with open(os.path.join(tmp, TOKENIZER_FILE), "wb") as f:
      f.write(tokenizer_json)
    written = sorted(os.listdir(tmp))
    sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in written}
    for name in written:
      os.replace(os.path.join(tmp, name), os.path.join(out_dir, name))
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  for name in os.listdir(out_dir):
    if OUTPUT.match(name) and name not in sizes:
      os.remove(os.path.join(out_dir, name))
  return sizes


# --- the whole job --------------------------------------------------------------------------


class Progress:
  """A console progress line over a known number of bytes: redrawn in place on a terminal,
  else printed at every 25%."""

  def __init__(self, what: str, total: int, stream=None):
    self.what, self.total, self.done = what, max(1, total), 0
    self.stream = stream or sys.stdout
    self.tty = self.stream.isatty()
    self._shown = -1 if self.tty else 0

  def __call__(self, nbytes: int) -> None:
    self.done += nbytes
    percent = min(100, 100 * self.done // self.total)
    step = percent if self.tty else percent // 25 * 25
    if step != self._shown:
      self._shown = step
      bar = "#" * (percent // 5) + "." * (20 - percent // 5)
      end = "\r" if self.tty and percent < 100 else "\n"
      self.stream.write(f"{self.what}: [{bar}] {percent:3d}% of {self.total / 1e6:.1f} MB{end}")
      self.stream.flush()


def _tokenizer_for(request: Request, files, loaded, say, total: int):
  """(tokenizer, its JSON bytes): `loaded`'s file as it is, or one trained on `files`."""
  if loaded is not None:
    with open(request.tokenizer, "rb") as f:
      return loaded, f.read()
  say(f"training a byte-level BPE tokenizer of {request.vocab_size} tokens")
  progress = Progress("  training", total)
  tokenizer = train_tokenizer(_documents_text(files, progress), request.vocab_size,
                              request.eot_token)
  return tokenizer, (tokenizer.to_str(pretty=True) + "\n").encode("utf-8")


def prepare(request: Request, say: Callable[[str], None] = print) -> Summary:
  """Tokenizes `request.input` and writes the shards and tokenizer.json (module doc).

  Args:
    request: what to prepare.
    say: prints a console line (progress lines are written to stdout directly).

  Returns:
    What was written.
  """
  request, files, loaded = check(request)
  total = sum(os.path.getsize(f) for f in files)
  say(f"input: {request.input}, {len(files)} files, {total / 1e6:.1f} MB")
  clock = time.perf_counter()
  tokenizer, tokenizer_json = _tokenizer_for(request, files, loaded, say, total)
  seconds = {"tokenizer": time.perf_counter() - clock}
  eot = tokenizer.token_to_id(request.eot_token)
  dtype = "uint16" if request.vocab_size <= 2**16 else "uint32"
  clock = time.perf_counter()
  tokens = encode(tokenizer, files, eot, dtype, Progress("  encoding", total))
  seconds["encode"] = time.perf_counter() - clock
  clock = time.perf_counter()
  shards = cut(tokens, request.val_fraction, request.shard_tokens)
  sizes = write_outputs(request.out_dir, shards, tokenizer_json, vocab_size=request.vocab_size,
                        eot=eot)
  seconds["write"] = time.perf_counter() - clock
  count = lambda kind: sum(len(v) for k, v in shards.items() if k.startswith(kind))
  return Summary(request.out_dir, sizes, len(files), total, request.vocab_size,
                 tokenizer.get_vocab_size(), eot, count("train"), count("val"),
                 sum(sizes.values()), seconds)


def describe(summary: Summary) -> list[str]:
  """The console lines that report `summary`, the last one the config overrides to use it."""
  shards = lambda kind: _count(sum(n.startswith(kind) and n.endswith(".bin")
                                   for n in summary.files), "shard")
  tokens = summary.train_tokens + summary.val_tokens
  lines = [
      f"wrote {summary.out_dir}: {summary.train_tokens:,} training tokens in {shards('train')}, "
      f"{summary.val_tokens:,} validation tokens in {shards('val')}, "
      f"{summary.disk_bytes / 1e6:.1f} MB on disk, {TOKENIZER_FILE} "
      f"(vocab_size {summary.vocab_size}, end token id {summary.eot})",
      f"{_count(summary.documents, 'document')}, {summary.text_bytes / tokens:.2f} bytes per "
      "token; " + ", ".join(f"{k} {v:.1f} s" for k, v in summary.seconds.items())]
  if summary.learned < summary.vocab_size:
    lines.append(f"note: the text gave {summary.learned} tokens, fewer than vocab_size "
                 f"{summary.vocab_size}; the ids from {summary.learned} on are never used")
  lines.append("train on them: " + " ".join(overrides(summary.out_dir, summary.vocab_size)))
  return lines


# --- configs --------------------------------------------------------------------------------


def shard_fields(out_dir: str, vocab_size: int) -> dict:
  """The config fields that train on the shards `prepare` wrote in `out_dir`."""
  return {"data.name": "tokens", "data.path": os.path.join(out_dir, "train_*.bin"),
          "data.val_path": os.path.join(out_dir, "val_*.bin"), "model.vocab_size": vocab_size}


def overrides(out_dir: str, vocab_size: int) -> list[str]:
  """`shard_fields` as command-line overrides (--config.data.name=tokens ...)."""
  return [f"--config.{k}=" + (f"'{v}'" if "*" in str(v) else str(v))
          for k, v in shard_fields(out_dir, vocab_size).items()]


def use_shards(config, out_dir: str, vocab_size: int) -> None:
  """Sets `shard_fields` on the ConfigDict `config` (for a config file)."""
  for key, value in shard_fields(out_dir, vocab_size).items():
    section, field = key.split(".")
    config[section][field] = value
