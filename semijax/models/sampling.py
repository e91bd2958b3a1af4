"""Text from a language model: autoregressive decoding over a causal model's logits.

`generate` feeds a window of the last `seq_len` tokens (right-padded with id 0, which the
causal mask keeps from every real position) and reads the logits at its last real position;
one compiled program serves every step. No key/value cache: each new token reruns the window,
which is fine for looking at what a run learned, not for serving.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


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


def generate(logits_fn: Callable[[Any, jax.Array], jax.Array], params, prompt: Sequence[int],
             num_tokens: int, *, seq_len: int, temperature: float = 0.0, top_k: int = 0,
             seed: int = 0) -> list[int]:
  """`prompt` followed by `num_tokens` new token ids.

  Args:
    logits_fn: (params, int32 tokens [1, seq_len]) -> logits [1, seq_len, V] of a causal model
      (position i sees tokens <= i); traced once, with `params` an argument (not constants).
    params: the model's parameters, as `logits_fn` takes them.
    prompt: at least one token id.
    seq_len: the model's context: each step sees the last `seq_len` tokens.
    temperature, top_k: as for `pick`; seed: the draws' PRNG seed.
  """
  if not prompt:
    raise ValueError("prompt: need at least one token")

  @jax.jit
  def step(params, window, last, key):
    return pick(logits_fn(params, window)[0, last], key, temperature, top_k)

  tokens, key = [int(t) for t in prompt], jax.random.key(seed)
  for _ in range(num_tokens):
    seen = tokens[-seq_len:]
    window = np.zeros((1, seq_len), np.int32)
    window[0, :len(seen)] = seen
    key, draw = jax.random.split(key)
    tokens.append(int(step(params, window, np.int32(len(seen) - 1), draw)))
  return tokens
