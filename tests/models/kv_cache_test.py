"""Decoding with a key/value cache (`core.decoder`, `core.kv_cache`): an uneven 4-device GPT and
Llama (a device owning no KV group, another no MLP unit) read a right-padded prompt window, then
two tokens, then one at a time; every position's logits equal the independent dense reference's
logits of the whole sequence (and, in bfloat16 with a bfloat16 cache, the model's own forward
pass), and the tokens `sampling.generate` draws with the cache, past the end of the context
too, are those of the model rerun on every window."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dense_reference as ref
import helpers as H
import llama_reference as llama_ref
from semijax.core import decoder as decoder_lib
from semijax.core import engine as engine_lib
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import precision as precision_lib
from semijax.models import llama
from semijax.models import sampling
from semijax.models import tasks

LLAMA_KW = dict(vocab_size=64, seq_len=8, d_model=32, num_heads=8, num_kv_heads=4, d_ff=48,
                num_layers=2)
ATOL = 2e-5


def engine_and_reference(model):
  """(4-device engine, an uneven layout of it, reference logits_fn(logical arrays, tokens))."""
  if model == "gpt":
    eng = H.make_engine("gpt", 1, 4)
    layout = H.random_layout(3, 4)
    def reference(arrays, tokens):
      g, p = ref.build(ref.GPT, arrays, **H.GPT_KW)
      return ref.apply(g, p, tokens)
    return eng, layout, reference
  eng = engine_lib.Engine(lambda rngs: llama.Llama(rngs=rngs, **LLAMA_KW), tasks.language_model,
                          mesh_lib.make_mesh(1, 4), optax.adamw(1e-2))
  layout = L.Layout(mlp=L.UnitLayout.from_counts("mlp", (20, 0, 12, 16), capacity=24),
                    heads=L.UnitLayout.from_counts("heads", (0, 2, 1, 1), capacity=3))
  return eng, layout, lambda arrays, tokens: llama_ref.logits(arrays, tokens,
                                                              LLAMA_KW["num_heads"])


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_cached_decoding_gives_the_dense_logits_of_the_whole_sequence(model):
  eng, layout, reference = engine_and_reference(model)
  state = eng.init(0, layout)
  arrays = eng.logical_arrays(eng.to_logical(state.params, layout))
  seq_len = 8
  tokens = np.random.default_rng(1).integers(0, 64, (1, seq_len)).astype(np.int32)
  want = np.asarray(reference(arrays, tokens))[0]                       # [seq_len, vocab]

  dec = decoder_lib.Decoder(eng, eng.plan(layout), seq_len)
  cache = dec.init(state.params)
  assert [(c.shape, c.dtype) for c in cache[0]] == [(
      (1, seq_len, 4 * layout.heads.capacity, H.GPT_KW["d_model"] // H.GPT_KW["num_heads"]),
      np.float32)] * 2
  np.testing.assert_allclose(decode_in_pieces(dec, state.params, tokens), want, atol=ATOL)


def decode_in_pieces(dec, params, tokens):
  """Logits [seq_len, vocab] of tokens [1, seq_len] read as a prompt of 3 right-padded to the
  window (the padding's keys and values stay in the cache past position 2 until the tokens
  that follow overwrite them), then 2 tokens at once, then one at a time."""
  window = np.zeros_like(tokens)
  window[0, :3] = tokens[0, :3]
  logits, cache = dec(params, window, dec.init(params), np.int32(0))
  got = [np.asarray(logits)[0, :3]]
  logits, cache = dec(params, tokens[:, 3:5], cache, np.int32(3))
  got.append(np.asarray(logits)[0])
  for pos in range(5, tokens.shape[1]):
    logits, cache = dec(params, tokens[:, pos:pos + 1], cache, np.int32(pos))
    got.append(np.asarray(logits)[0])
  return np.concatenate(got)


def test_a_bfloat16_cache_decodes_like_the_bfloat16_forward():
  eng = H.make_engine("gpt", 1, 4, precision=precision_lib.Precision("bfloat16"))
  layout = H.random_layout(3, 4)
  params = eng.init(0, layout).params
  plan = eng.plan(layout)
  tokens = np.random.default_rng(1).integers(0, 64, (1, 8)).astype(np.int32)
  dec = decoder_lib.Decoder(eng, plan, 8)
  assert {c.dtype for c in jax.tree.leaves(dec.init(params))} == {jnp.dtype(jnp.bfloat16)}
  want = np.asarray(eng.logits(params, {"inputs": tokens}, plan))[0]
  got = decode_in_pieces(dec, params, tokens)
  # The same bfloat16 roundings (equal here to 3e-8); at most about one bfloat16 step of logits
  # near 3 where XLA orders a sum otherwise.
  np.testing.assert_allclose(got, want, atol=0.02)


def test_generate_with_the_cache_draws_the_tokens_of_the_recomputed_windows():
  eng, layout, _ = engine_and_reference("llama")
  state = eng.init(0, layout)
  plan = eng.plan(layout)
  logits_fn = lambda params, tokens: eng.logits(params, {eng.input_key: tokens}, plan)
  cached = decoder_lib.Decoder(eng, plan, 8)
  rerun = sampling.Recomputing(logits_fn, 8)
  prompt = [5, 17, 42, 3, 9]
  # Greedy: 3 tokens inside the context, then 7 past it (each read with the last 8 again).
  greedy = sampling.generate(cached, state.params, prompt, 10)
  assert greedy == sampling.generate(rerun, state.params, prompt, 10)
  drawn = sampling.generate(cached, state.params, prompt, 10, temperature=1.0, top_k=8, seed=3)
  assert drawn == sampling.generate(rerun, state.params, prompt, 10, temperature=1.0, top_k=8,
                                    seed=3)
  assert drawn != greedy
