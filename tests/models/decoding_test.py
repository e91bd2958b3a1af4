"""Decoding (`models.sampling`) on a toy causal model whose next token is known, rerun on every
window (`sampling.Recomputing`): the prompt's window of the last seq_len tokens, right-padded,
is read at its last real position, each new token at the next one, and past the context the
window slides."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from semijax.models import sampling

VOCAB = 8


def successor_logits(shift, tokens):
  """A causal toy: position i predicts tokens[i] + shift (mod VOCAB) with logit 10, others 0."""
  return 10.0 * jax.nn.one_hot((tokens + shift) % VOCAB, VOCAB)


def test_greedy_decoding_reads_the_last_real_position_of_a_sliding_window():
  # seq_len 4, so from the fifth token on the window slides; a read of a padded position or of
  # the window's end would give 0 + shift instead.
  toy = sampling.Recomputing(successor_logits, 4)
  out = sampling.generate(toy, jnp.int32(3), [5], 10)
  assert out == [5] + [(5 + 3 * (i + 1)) % VOCAB for i in range(10)]
  long_prompt = [1, 2, 3, 4, 5, 6]                 # longer than the context: its tail counts
  assert sampling.generate(toy, jnp.int32(1), long_prompt, 2) == (
      long_prompt + [7, 0])
  with pytest.raises(ValueError, match="prompt: need at least one token"):
    sampling.generate(toy, jnp.int32(1), [], 2)


def test_draws_stay_in_the_top_k_and_repeat_with_their_seed():
  logits = jnp.log(jnp.array([0.3, 0.25, 0.2, 0.1, 0.05, 0.05, 0.03, 0.02]))
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.jit(jax.vmap(lambda k: sampling.pick(logits, k, 1.0, 3)))
  drawn = np.asarray(draw(keys))
  assert set(drawn.tolist()) == {0, 1, 2}          # the three most likely, each drawn
  counts = np.bincount(drawn, minlength=3) / len(drawn)
  np.testing.assert_allclose(counts, np.array([0.3, 0.25, 0.2]) / 0.75, atol=0.08)
  assert int(sampling.pick(logits, keys[0], 5.0, 1)) == 0     # top_k 1 is greedy
  assert int(sampling.pick(logits, keys[0], 0.0, 0)) == 0
  cold = np.asarray(jax.vmap(lambda k: sampling.pick(logits, k, 1e-3, 0))(keys[:50]))
  assert not np.any(cold)                                     # a cold draw is the argmax
  flat = sampling.Recomputing(lambda p, t: jnp.broadcast_to(logits, t.shape + (VOCAB,)), 4)
  noisy = lambda seed: sampling.generate(flat, None, [0], 12, temperature=1.0, seed=seed)
  assert noisy(7) == noisy(7) and noisy(7) != noisy(8)
