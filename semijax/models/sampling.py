"""Text from a language model: autoregressive decoding over a causal model's logits.

`generate` reads the prompt's last `seq_len` tokens from position 0 in one call of a `Decoder`
(right-padded with id 0: a causal model's real positions never see the padding), then each new
token in a call of its own at the next position, the decoder keeping what it read: a
`core.decoder.Decoder` keeps every layer's keys and values (a step costs one token's work),
`Recomputing` only the tokens (each step reruns the model on the whole window). One compiled
program reads the window, one a token. Once the context is full, the positions would have to
shift: each further token is then read with the last `seq_len` tokens from position 0 again
(what the model saw in training), at the window's cost.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np


class Decoder(Protocol):
  """A causal model read a few tokens at a time, keeping what it has read in a cache."""

  seq_len: int    # the context: positions 0 .. seq_len - 1

  def init(self, params) -> Any:
    """An empty cache."""

  def __call__(self, params, tokens: jax.Array, cache: Any, pos: jax.Array
               ) -> tuple[jax.Array, Any]:
    """(logits [1, T, V] of tokens int32 [1, T] at positions pos .. pos + T - 1, which see the
    cached tokens before pos and each other causally; the cache with them). Traceable."""


@dataclasses.dataclass(frozen=True)
class Recomputing:
  """A `Decoder` without a key/value cache: its cache is the window of tokens [1, seq_len] read
  so far, and every call runs `logits_fn` on the whole window.

  Attributes:
    logits_fn: (params, int32 tokens [1, seq_len]) -> logits [1, seq_len, V] of a causal model
      (position i sees tokens <= i).
    seq_len: the model's context.
  """

  logits_fn: Callable[[Any, jax.Array], jax.Array]
  seq_len: int

  def init(self, params) -> jax.Array:
    del params
    return jnp.zeros((1, self.seq_len), jnp.int32)

  def __call__(self, params, tokens, cache, pos):
    window = jax.lax.dynamic_update_slice_in_dim(cache, tokens, pos, axis=1)
    logits = self.logits_fn(params, window)
    return jax.lax.dynamic_slice_in_dim(logits, pos, tokens.shape[1], axis=1), window


def pick(logits: jax.Array, key: jax.Array, temperature: float, top_k: int) -> jax.Array:
  """The next token (int32 []) from logits [V]: the most likely where `temperature` is 0, else a
  draw from softmax(logits / temperature) restricted to the `top_k` most likely (all where
  `top_k` is 0)."""
  if temperature == 0:
    return jnp.argmax(logits).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / temperature
  if top_k:
    kth = jax.lax.top_k(logits, top_k)[0][-1]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  return jax.random.categorical(key, logits).astype(jnp.int32)


def generate(decoder: Decoder, params, prompt: Sequence[int], num_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, seed: int = 0) -> list[int]:
  """`prompt` followed by `num_tokens` new token ids (see module doc).

  Args:
    decoder: the model (`Decoder`); its calls are compiled with `params` an argument (not
      constants) and the cache donated.
    params: the model's parameters, as `decoder` takes them.
    prompt: at least one token id.
    temperature, top_k: as for `pick`; seed: the draws' PRNG seed.
  """
  if not prompt:
    raise ValueError("prompt: need at least one token")
  seq_len = decoder.seq_len

  @functools.partial(jax.jit, donate_argnums=(2,))
  def step(params, tokens, cache, pos, last, key):
    logits, cache = decoder(params, tokens, cache, pos)
    return pick(logits[0, last], key, temperature, top_k), cache

  tokens, key = [int(t) for t in prompt], jax.random.key(seed)
  # A window read writes every position of the cache, so one cache serves the whole run.
  cache, pos = decoder.init(params), seq_len
  for _ in range(num_tokens):
    key, draw = jax.random.split(key)
    if pos == seq_len:       # the context is full (or nothing is read yet): read the window
      seen = tokens[-seq_len:]
      window = np.zeros((1, seq_len), np.int32)
      window[0, :len(seen)] = seen
      token, cache = step(params, window, cache, np.int32(0), np.int32(len(seen) - 1), draw)
      pos = len(seen)
    else:                    # the newest token, at the next position
      token, cache = step(params, np.asarray([tokens[-1:]], np.int32), cache, np.int32(pos),
                          np.int32(0), draw)
      pos += 1
    tokens.append(int(token))
  return tokens
