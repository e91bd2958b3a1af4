"""Token shards on disk: flat arrays of token ids, each with a small JSON header beside it.

A shard is nanoGPT's `.bin` layout: the raw little-endian token ids, uint16 or uint32, nothing
else in the file. Its header is the file `<shard>.json` (`header_path`):

    {"dtype": "uint16" | "uint32", "vocab_size": int, "tokenizer": str,
     "num_tokens": int, "eot": int | null}

`tokenizer` names what made the ids (a tokenizer file's name, or "bytes"); `eot` is the token
that ends each document (null: none). The file holds exactly num_tokens * itemsize bytes.

`open_shards` maps the shards a path or glob names with `np.memmap`: nothing is read until a
batch reads its windows, so a run on a file of many GB starts at once and its resident memory
does not grow with the file. It checks every header against its file and the shards against
each other, but not the ids themselves: an id >= vocab_size would mean reading the whole file,
so it is left to whoever wrote the shard (`write_shard` refuses one). Every check raises a
`ConfigError` whose message starts with the config field it is about ("config.data.path: ...").
"""

from __future__ import annotations

import dataclasses
import glob
import json
import numbers
import os

import numpy as np

from semijax.errors import ConfigError

DTYPES = ("uint16", "uint32")
HEADER_KEYS = ("dtype", "vocab_size", "tokenizer", "num_tokens", "eot")
MAX_VOCAB = 2**31 - 1   # the batches hold ids as int32


@dataclasses.dataclass(frozen=True)
class ShardHeader:
  """A shard's header (see the module docstring); `num_tokens` is the shard's length."""

  dtype: str
  vocab_size: int
  tokenizer: str
  num_tokens: int
  eot: int | None = None

  @property
  def vocabulary(self) -> tuple:
    """(dtype, vocab_size, tokenizer, eot): what every shard of one corpus shares."""
    return self.dtype, self.vocab_size, self.tokenizer, self.eot

  @property
  def itemsize(self) -> int:
    return np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Shards:
  """The shards a path or glob names, in sorted path order.

  Attributes:
    paths: the shard files.
    tokens: one read-only `np.memmap` per shard: [num_tokens], little-endian `header.dtype`.
    header: the first shard's header (all shards share its `vocabulary`).
  """

  paths: tuple[str, ...]
  tokens: tuple[np.ndarray, ...]
  header: ShardHeader

  @property
  def header_file(self) -> str:
    return header_path(self.paths[0])


def header_path(shard: str) -> str:
  """Where the header of the shard at `shard` lies: `<shard>.json`."""
  return shard + ".json"


# --- writing --------------------------------------------------------------------------------


def write_shard(path: str, tokens, *, vocab_size: int, tokenizer: str,
                eot: int | None = None) -> ShardHeader:
  """Writes `tokens` as a shard at `path` and its header at `header_path(path)`.

  Each file is written to a temporary file beside it and renamed over the old one (os.replace),
  so a reader never sees half a file; the same arguments always write the same bytes.

  Args:
    path: the shard file (its directory must exist).
    tokens: integer ids [num_tokens] (any integer dtype), each in [0, vocab_size); not empty.
    vocab_size: the vocabulary's size; <= 65536 stores uint16 ids, larger uint32.
    tokenizer: what made the ids (a tokenizer file's name, or "bytes").
    eot: the documents' end token, or None.

  Returns:
    The header written.
  """
  tokens = np.asarray(tokens)
  header = _new_header(tokens, vocab_size, tokenizer, eot)
  data = np.ascontiguousarray(tokens, np.dtype(header.dtype).newbyteorder("<"))
  _replace(path, data.tobytes())
  text = json.dumps(dataclasses.asdict(header), sort_keys=True, indent=1) + "\n"
  _replace(header_path(path), text.encode("utf-8"))
  return header


def _new_header(tokens: np.ndarray, vocab_size, tokenizer, eot) -> ShardHeader:
  """The header of `tokens`, or ValueError when they cannot make a shard."""
  if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral) \
      or not 1 <= vocab_size <= MAX_VOCAB:
    raise ValueError(f"vocab_size: need an integer in [1, {MAX_VOCAB}], got {vocab_size!r}")
  if not isinstance(tokenizer, str) or not tokenizer:
    raise ValueError(f"tokenizer: need a non-empty string, got {tokenizer!r}")
  if eot is not None and not _is_id(eot, vocab_size):
    raise ValueError(f"eot: need None or an id in [0, {vocab_size}), got {eot!r}")
  if tokens.ndim != 1 or not len(tokens) or not np.issubdtype(tokens.dtype, np.integer):
    raise ValueError(f"tokens: need a non-empty 1-D integer array, got {tokens.dtype} "
                     f"{tokens.shape}")
  lo, hi = int(tokens.min()), int(tokens.max())
  if lo < 0 or hi >= vocab_size:
    raise ValueError(f"tokens: ids span [{lo}, {hi}], outside [0, {vocab_size})")
  dtype = "uint16" if vocab_size <= 2**16 else "uint32"
  return ShardHeader(dtype, int(vocab_size), tokenizer, len(tokens),
                     None if eot is None else int(eot))


def _replace(path: str, data: bytes) -> None:
  """Writes `data` to a temporary file beside `path`, then renames it to `path`."""
  directory, name = os.path.split(os.path.abspath(path))
  tmp = os.path.join(directory, f".{name}.tmp{os.getpid()}")
  try:
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


# --- reading --------------------------------------------------------------------------------


def open_shards(pattern: str, field: str = "config.data.path") -> Shards:
  """Maps the shards that `pattern` (a path or a glob) names, checking their headers.

  Files whose name ends in ".json" (the headers) are not shards. Refuses, naming `field`: a
  pattern that matches no file, a shard without a readable header, a header with a missing or
  bad field, a file whose size is not num_tokens * itemsize, an empty shard, and shards whose
  vocabularies (dtype, vocab_size, tokenizer, eot) differ. Token ids are not checked against
  vocab_size (that would read every file).
  """
  paths = sorted(p for p in glob.glob(os.path.expanduser(pattern))
                 if os.path.isfile(p) and not p.endswith(".json"))
  if not paths:
    raise ConfigError(f"{field}: no token shard matches {pattern!r}{_prepare_hint(pattern)}")
  tokens, headers = zip(*(open_shard(p, field) for p in paths))
  for path, header in zip(paths[1:], headers[1:]):
    check_same_vocabulary(header, headers[0], f"{field}: {path}", header_path(paths[0]))
  return Shards(tuple(paths), tuple(tokens), headers[0])


def _prepare_hint(pattern: str) -> str:
  """How to write shards where `pattern` looks for them (experiments/prepare_data.py)."""
  directory = os.path.dirname(pattern)
  if not pattern or glob.has_magic(directory):
    return ""
  return (f"; python experiments/prepare_data.py --out_dir={directory or '.'} writes them "
          "(from the standard library's sources; --input=PATH for other text, docs/data.md)")


def open_shard(path: str, field: str) -> tuple[np.ndarray, ShardHeader]:
  """The shard at `path` as a read-only np.memmap [num_tokens] and its checked header."""
  header = read_header(path, field)
  size = os.path.getsize(path)
  if size == 0 or header.num_tokens == 0:
    raise ConfigError(f"{field}: {path} is empty ({size} bytes, header {header_path(path)} says "
                      f"{header.num_tokens} tokens)")
  if size != header.num_tokens * header.itemsize:
    raise ConfigError(f"{field}: {path} holds {size} bytes, but its header "
                      f"{header_path(path)} says {header.num_tokens} {header.dtype} tokens "
                      f"({header.num_tokens * header.itemsize} bytes)")
  dtype = np.dtype(header.dtype).newbyteorder("<")
  try:
    return np.memmap(path, dtype, mode="r", shape=(header.num_tokens,)), header
  except OSError as e:
    raise ConfigError(f"{field}: cannot map {path}: {e.strerror or e}") from None


def read_header(path: str, field: str) -> ShardHeader:
  """The checked header of the shard at `path` (ConfigError naming `field` if bad)."""
  where = header_path(path)
  try:
    with open(where, encoding="utf-8") as f:
      raw = json.load(f)
  except FileNotFoundError:
    raise ConfigError(f"{field}: {path} has no header {where} (semijax.train.tokens."
                      "write_shard writes both)") from None
  except (OSError, ValueError) as e:
    raise ConfigError(f"{field}: cannot read the header {where} as JSON: {e}") from None
  return _parse_header(raw, f"{field}: header {where}")


def _parse_header(raw, where: str) -> ShardHeader:
  """`raw` (a header's JSON) as a ShardHeader; `where` starts every error message."""
  if not isinstance(raw, dict):
    raise ConfigError(f"{where}: need a JSON object with keys {HEADER_KEYS}")
  missing = [k for k in HEADER_KEYS if k not in raw]
  if missing:
    raise ConfigError(f"{where}: lacks {missing} (need {HEADER_KEYS})")
  dtype, vocab, tokenizer, num, eot = (raw[k] for k in HEADER_KEYS)
  if dtype not in DTYPES:
    raise ConfigError(f"{where}: dtype {dtype!r} is not one of {DTYPES}")
  limit = min(MAX_VOCAB, np.iinfo(dtype).max + 1)
  if not _is_int(vocab) or not 1 <= vocab <= limit:
    raise ConfigError(f"{where}: vocab_size {vocab!r} is not an integer in [1, {limit}] (the "
                      f"ids a {dtype} shard can hold)")
  if not _is_int(num) or num < 0:
    raise ConfigError(f"{where}: num_tokens {num!r} is not an integer >= 0")
  if not isinstance(tokenizer, str) or not tokenizer:
    raise ConfigError(f"{where}: tokenizer {tokenizer!r} is not a non-empty string")
  if eot is not None and not _is_id(eot, vocab):
    raise ConfigError(f"{where}: eot {eot!r} is not null or an id in [0, {vocab})")
  return ShardHeader(dtype, int(vocab), tokenizer, int(num), None if eot is None else int(eot))


def check_same_vocabulary(header: ShardHeader, first: ShardHeader, where: str,
                          first_where: str) -> None:
  """Refuses `header` unless it shares `first`'s vocabulary; `where` starts the message."""
  if header.vocabulary != first.vocabulary:
    names = ("dtype", "vocab_size", "tokenizer", "eot")
    raise ConfigError(f"{where} has vocabulary {dict(zip(names, header.vocabulary))}, but "
                      f"{first_where} says {dict(zip(names, first.vocabulary))}; all shards "
                      "must share one")


def check_vocab_size(shards: Shards, vocab_size: int) -> None:
  """Refuses a model vocabulary (`config.model.vocab_size`) that is not the shards'."""
  if vocab_size != shards.header.vocab_size:
    raise ConfigError(f"config.model.vocab_size: {vocab_size} but the token shards' vocabulary "
                      f"is {shards.header.vocab_size} (header {shards.header_file})")


def _is_int(value) -> bool:
  return not isinstance(value, bool) and isinstance(value, numbers.Integral)


def _is_id(value, vocab_size: int) -> bool:
  """Whether `value` is an integer id in [0, vocab_size)."""
  return _is_int(value) and 0 <= value < vocab_size
