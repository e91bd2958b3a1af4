"""The peer benchmark with --model=llama: the plain-JAX Llama is semijax's Llama (the same loss
from the same parameters, even and uneven KV-group layouts, both precisions), its programs train
alike, and its flags are checked by name."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from benchmarks import peer
from benchmarks import plain_llama

TINY = peer.Settings(model="llama", kv_heads=4, d_model=32, d_ff=64, heads=8, layers=2,
                     seq_len=16, batch=8, tensor=4, uneven=0.5, num_widths=3, steps=2, rounds=2)


@pytest.mark.parametrize("precision,rtol", [("float32", 2e-6), ("bfloat16", 1e-3)])
@pytest.mark.parametrize("layout_name", ["even", "uneven"])
def test_plain_llama_computes_semijax_loss_from_the_same_parameters(precision, rtol,
                                                                    layout_name):
  want, logical = H.peer_semijax_loss(TINY, precision, layout_name)
  params = peer.plain_params(logical, "llama")
  got = plain_llama.loss(params, peer.batch(TINY), dtype=jnp.dtype(precision))
  assert float(got) == pytest.approx(want, rel=rtol)
  # The loss depends on every kind of parameter: a wrong conversion (groups, a norm) shows.
  params["blocks"][1]["attn"]["wk"] = params["blocks"][1]["attn"]["wk"][:, ::-1]
  params["blocks"][0]["mlp_norm"] = params["blocks"][0]["mlp_norm"] * 2.0
  assert abs(float(plain_llama.loss(params, peer.batch(TINY))) - want) > 1e-3


def test_the_uneven_layout_splits_kv_groups():
  lay = peer.layouts(TINY)
  assert lay["even"].heads.counts == (1,) * 4 and lay["even"].heads.num_units == 4
  assert lay["uneven"].mlp.counts[0] < min(lay["uneven"].mlp.counts[1:])


def test_the_three_programs_train_alike_in_float32():
  semi, engine = peer.semijax_programs(TINY, "float32", peer.batch(TINY))
  programs = {"plain": peer.plain_program(TINY, "float32", engine, peer.batch(TINY)), **semi}
  losses = {k: [float(p()) for _ in range(4)] for k, p in programs.items()}
  plain = losses.pop("plain")
  assert plain[3] < plain[0] - 1e-4
  for name, got in losses.items():
    np.testing.assert_allclose(got, plain, rtol=1e-5, err_msg=name)


@pytest.mark.parametrize("change,message", [
    (dict(model="mamba"), r"^--model: 'mamba' is not one of"),
    (dict(kv_heads=3), r"^--kv_heads: 3 key/value heads must divide num_heads = 8"),
    (dict(d_model=24, heads=8, kv_heads=4),
     r"^--heads: head_dim = d_model / num_heads = 3 must be even"),
    (dict(model="gpt", kv_heads=4), r"^--kv_heads: the gpt has no key/value groups"),
    (dict(tensor=8, kv_heads=4), r"^--tensor: 8 devices cannot each own a head and an MLP unit "
                                 r"of 4 heads units"),
])
def test_bad_llama_settings_name_their_flag(change, message):
  s = dataclasses.replace(TINY, **change)
  with pytest.raises(peer.ConfigError, match=message):
    s.validate(device_count=8, backend="cpu")
