r"""Tokenize text into token shards for `config.data.name = "tokens"` (docs/data.md).

  python experiments/prepare_data.py --input=stdlib --out_dir=data/stdlib_bpe4k --vocab_size=4096
  python experiments/prepare_data.py --input=/data/corpus --out_dir=data/corpus_bpe8k \
      --vocab_size=8192
  python experiments/prepare_data.py --input=notes.txt --out_dir=data/notes_gpt2 \
      --tokenizer=gpt2/tokenizer.json

--input is "stdlib" (this Python's standard-library sources), a text file, or a directory (its
files, recursively, in sorted order); each file is one document, followed by the end token
(--eot_token). A byte-level BPE tokenizer of --vocab_size tokens is trained on it (offline,
deterministically), or --tokenizer loads one. --out_dir gets tokenizer.json, train_000.bin, ...
and val_000.bin, ... (the last --val_fraction of the tokens), each shard at most --shard_tokens
tokens with its .json header. The same input and flags write the same bytes
(`semijax.train.prepare`).

Bad input ends the program before any work, with one line naming the flag ("--vocab_size: ...")
and a non-zero exit; nothing in --out_dir changes until every file is ready. The console shows the
progress and what was written; the library's INFO logs appear with --verbosity=0.
"""

from absl import app
from absl import flags

from semijax.runtime import cli
from semijax.train import prepare

_INPUT = flags.DEFINE_string("input", prepare.STDLIB, "'stdlib', a text file or a directory of "
                             "text files.")
_OUT_DIR = flags.DEFINE_string("out_dir", None, "Where the shards and tokenizer.json go.")
_VOCAB = flags.DEFINE_integer("vocab_size", None, "Tokens of the BPE vocabulary to train "
                              f"(default {prepare.DEFAULT_VOCAB}); not with --tokenizer.")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "A tokenizer.json to use instead of training "
                                 "one.")
_VAL = flags.DEFINE_float("val_fraction", 0.1, "Share of the tokens, at the end, in val_*.bin.")
_SHARD = flags.DEFINE_integer("shard_tokens", prepare.DEFAULT_SHARD_TOKENS, "Most tokens in one "
                              "shard.")
_EOT = flags.DEFINE_string("eot_token", prepare.EOT, "The special token after every document.")
flags.mark_flags_as_required(["out_dir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  with cli.one_line_errors():
    summary = prepare.prepare(prepare.Request(
        _INPUT.value, _OUT_DIR.value, vocab_size=_VOCAB.value, tokenizer=_TOKENIZER.value,
        val_fraction=_VAL.value, shard_tokens=_SHARD.value, eot_token=_EOT.value))
  for line in prepare.describe(summary):
    print(line)


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
