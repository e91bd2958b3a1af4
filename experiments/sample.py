r"""Text from a trained GPT or Llama: what a run's checkpoint continues a prompt with.

  python experiments/sample.py --workdir=runs/gpt --prompt="def main(" --tokens=200
  python experiments/sample.py --workdir=runs/gpt --prompt="import " --temperature=0.8 \
      --top_k=40 --seed=1

The run's config.json says the model and its data; the newest intact checkpoint (or --step) is
restored onto one device, whatever layout or device count it trained on. Text data sets and
byte-level shards decode as UTF-8; token shards use the tokenizer.json beside them
(`semijax.train.generate`). --temperature=0 (the default) takes the most likely token each time.
Decoding keeps every layer's keys and values, so each new token costs one token's work
(docs/workdir.md). Compiled programs are kept in JAX's persistent compilation cache, as for
train.py (--compilation_cache_dir, --nocompilation_cache), so a second prompt to the same run
compiles nothing. Bad input ends the program with one line naming the flag.
"""

from absl import app
from absl import flags

from semijax.errors import ConfigError
from semijax.runtime import cli
from semijax.train import generate

_WORKDIR = flags.DEFINE_string("workdir", None, "A training run's --workdir.")
_PROMPT = flags.DEFINE_string("prompt", "\n", "The text to continue.")
_TOKENS = flags.DEFINE_integer("tokens", 200, "Tokens to generate.")
_STEP = flags.DEFINE_integer("step", None, "The checkpoint to load (default: the newest intact).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: the most likely token; else draw from "
                                  "the softmax of the logits over this.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Draw among the k most likely tokens only (0: all).")
_SEED = flags.DEFINE_integer("seed", 0, "The draws' random seed.")
_CACHE, _CACHE_DIR = cli.define_cache_flags()
flags.mark_flags_as_required(["workdir"])


def check_flags() -> None:
  """Raises ConfigError naming the first bad flag."""
  if _TOKENS.value < 0:
    raise ConfigError(f"--tokens: need >= 0, got {_TOKENS.value}")
  if not _TEMPERATURE.value >= 0:
    raise ConfigError(f"--temperature: need >= 0, got {_TEMPERATURE.value}")
  if _TOP_K.value < 0:
    raise ConfigError(f"--top_k: need >= 0 (0: every token), got {_TOP_K.value}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"Too many command-line arguments: {argv[1:]}")
  with cli.one_line_errors():
    check_flags()
    cli.apply_cache_flags(_CACHE, _CACHE_DIR)
    model = generate.load(_WORKDIR.value, _STEP.value)
    vocab = model.run.model.kwargs["vocab_size"]
    if _TOP_K.value > vocab:
      raise ConfigError(f"--top_k: {_TOP_K.value} is more than the model's "
                        f"{vocab} tokens")
    print(f"{model.run.model.name} of {_WORKDIR.value}, step {model.step}; {model.codec.name}",
          flush=True)
    print(model.sample(_PROMPT.value, _TOKENS.value, temperature=_TEMPERATURE.value,
                       top_k=_TOP_K.value, seed=_SEED.value))


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
