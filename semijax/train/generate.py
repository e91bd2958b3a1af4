"""Text from a trained run's checkpoint (`experiments/sample.py`).

`load` reads a workdir's config.json, restores its newest intact checkpoint (or a given step)
onto one device, whatever layout, tensor device count and pipeline it was trained with, and
pairs the model with the codec of its data: UTF-8 bytes for the text data sets and byte-level
token shards, the shards' `tokenizer.json` otherwise. The sharded logical form restores onto
any device count; a pipelined run's as an unpipelined run restores it
(`tensor.restore_pipelined`).
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from typing import Any, Callable

import jax
import ml_collections

from semijax import models
from semijax.core import decoder as decoder_lib
from semijax.core import engine as engine_lib
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.errors import ConfigError
from semijax.models import sampling
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import metrics as metrics_lib
from semijax.train import optimizer as optimizer_lib
from semijax.train import tensor as tensor_lib
from semijax.train import tokens as tokens_lib


@dataclasses.dataclass
class Codec:
  """encode: text -> token ids; decode: token ids -> text; name: what it is."""

  encode: Callable[[str], list[int]]
  decode: Callable[[list[int]], str]
  name: str


def _bytes_codec() -> Codec:
  return Codec(lambda text: list(text.encode("utf-8")),
               lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", errors="replace"),
               "UTF-8 bytes")


def codec(run: config_lib.RunConfig) -> Codec:
  """The codec of the run's data (see module doc)."""
  if run.data.name != "tokens":
    return _bytes_codec()
  shards = sorted(glob.glob(run.data.path))
  if not shards:
    raise ConfigError(f"config.data.path: no token shards match {run.data.path!r} (the run's "
                      "tokenizer is read beside them)")
  header = tokens_lib.read_header(shards[0], "config.data.path")
  if header.tokenizer == "bytes":
    return _bytes_codec()
  path = os.path.join(os.path.dirname(shards[0]), header.tokenizer)
  try:
    import tokenizers      # the `data` extra
  except ImportError:
    raise ConfigError("tokenizers: not installed; pip install -e '.[data]'") from None
  tokenizer = tokenizers.Tokenizer.from_file(path)
  return Codec(lambda text: tokenizer.encode(text).ids, tokenizer.decode, path)


@dataclasses.dataclass
class Model:
  """A restored language model on one device: `logits(params, tokens)` maps int32 tokens
  [1, seq_len] to float32 logits [1, seq_len, vocab] (the whole window's forward), `decoder`
  reads them a few at a time with a key/value cache (`sampling.generate` decodes with it)."""

  run: config_lib.RunConfig
  step: int
  params: Any
  logits: Callable[[Any, jax.Array], jax.Array]
  decoder: decoder_lib.Decoder
  codec: Codec

  def sample(self, prompt: str, num_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0) -> str:
    """`prompt` and `num_tokens` tokens after it, as text (`sampling.generate`)."""
    ids = self.codec.encode(prompt)
    if not ids:
      raise ConfigError("--prompt: encodes to no tokens; give some text")
    out = sampling.generate(self.decoder, self.params, ids, num_tokens,
                            temperature=temperature, top_k=top_k, seed=seed)
    return self.codec.decode(out)


def load(workdir: str, step: int | None = None) -> Model:
  """The model of the run in `workdir` at `step` (default: its newest intact checkpoint).

  Raises:
    ConfigError: naming --workdir or --step where there is no such run or checkpoint, or the
      run did not train a language model.
  """
  path = os.path.join(workdir, metrics_lib.CONFIG_NAME)
  if not os.path.isfile(path):
    raise ConfigError(f"--workdir: {workdir} holds no {metrics_lib.CONFIG_NAME}; give the "
                      "--workdir of a training run")
  with open(path) as f:
    config = ml_collections.ConfigDict(json.load(f))
  run = config_lib.validate(config)
  if run.model.name not in ("gpt", "llama"):
    raise ConfigError(f"--workdir: the run trained a {run.model.name!r} model; text comes from "
                      "'gpt' or 'llama'")
  folder = os.path.join(workdir, "checkpoints")
  if not os.path.isdir(folder):
    raise ConfigError(f"--workdir: no checkpoints in {workdir} (the run saves them in "
                      "checkpoints/)")
  ckpt = checkpoint_lib.Checkpointer(folder)
  try:
    if step is None:
      step = ckpt.latest_intact_step(collective=False)
      if step is None:
        raise ConfigError(f"--workdir: no intact checkpoint in {ckpt.directory}")
    elif step not in ckpt.all_steps() or ckpt.verify(step, False) is not None:
      raise ConfigError(f"--step: no intact checkpoint {step} in {ckpt.directory} (there are "
                        f"{ckpt.all_steps()})")
    engine = engine_lib.Engine(*models.build(run.model),
                               mesh_lib.make_mesh(1, 1, jax.devices()[:1]),
                               optimizer_lib.make(run.optimizer, run.steps))
    if run.pipeline is not None:
      logical = tensor_lib.restore_pipelined(engine, ckpt, step)[0].params
    else:
      logical = ckpt.restore(engine.abstract_logical(), step)[0].params
  finally:
    ckpt.close()
  units = run.model.num_units()
  layout = layout_lib.Layout.for_model(d_model=run.model.d_model, num_heads=units["heads"],
                                       d_ff=run.model.d_ff, num_devices=1)
  params = engine.to_padded(logical, layout, donate=True)
  plan = engine.plan(layout)
  logits = lambda params, tokens: engine.logits(params, {engine.input_key: tokens}, plan)
  decoder = decoder_lib.Decoder(engine, plan, run.model.seq_len)
  return Model(run, step, params, logits, decoder, codec(run))
