"""The peer benchmark: the plain-JAX GPT is semijax's model, its programs train alike, its flags
are checked, and a smoke run of experiments/bench_peer.py writes every cell."""

import collections
import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import helpers as H
from benchmarks import peer
from benchmarks import plain_gpt
from semijax.core import plan as plan_lib
from semijax.train import optimizer as optimizer_lib

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = peer.Settings(d_model=32, d_ff=64, heads=8, layers=2, seq_len=16, batch=8, tensor=4,
                     uneven=0.5, num_widths=3, steps=2, rounds=2)


@pytest.mark.parametrize("precision,rtol", [("float32", 2e-6), ("bfloat16", 1e-3)])
@pytest.mark.parametrize("layout_name", ["even", "uneven"])
def test_plain_gpt_computes_semijax_loss_from_the_same_parameters(precision, rtol, layout_name):
  want, logical = H.peer_semijax_loss(TINY, precision, layout_name)
  got = plain_gpt.loss(peer.plain_params(logical), peer.batch(TINY), num_heads=TINY.heads,
                       dtype=jnp.dtype(precision))
  assert float(got) == pytest.approx(want, rel=rtol)
  # The loss depends on the parameters: a wrong conversion (heads, a missing bias) shows.
  moved = peer.plain_params(logical)
  moved["blocks"][1]["attn"]["bq"] = moved["blocks"][1]["attn"]["bq"] + 1.0
  moved["blocks"][0]["mlp"]["b1"] = moved["blocks"][0]["mlp"]["b1"] + 1.0
  assert abs(float(plain_gpt.loss(moved, peer.batch(TINY), num_heads=TINY.heads)) - want) > 1e-3


def test_plain_gpt_runs_its_gemms_in_the_compute_dtype_and_returns_float32_logits():
  logical = H.peer_semijax_loss(TINY, "float32", "even")[1]
  tokens = peer.batch(TINY)["inputs"]
  fn = lambda p: plain_gpt.logits(p, tokens, num_heads=TINY.heads, dtype=jnp.bfloat16)
  jaxpr = jax.make_jaxpr(fn)(peer.plain_params(logical))
  dots = [e for e in jaxpr.eqns if e.primitive.name == "dot_general"]
  # Per block: q, k, v, out, two MLP GEMMs, and the scores and values of attention; the head.
  assert len(dots) == 8 * TINY.layers + 1
  assert all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
  assert jax.eval_shape(fn, peer.plain_params(logical)).dtype == jnp.float32


def test_the_three_programs_train_alike_in_float32():
  # Two optimizer steps after the first (the schedule's first rate is 0): the losses follow the
  # same trajectory, so gradients, clip and AdamW agree, on 4 tensor devices and a split batch.
  semi, engine = peer.semijax_programs(TINY, "float32", peer.batch(TINY))
  programs = {"plain": peer.plain_program(TINY, "float32", engine, peer.batch(TINY)), **semi}
  losses = {k: [float(p()) for _ in range(4)] for k, p in programs.items()}
  plain = losses.pop("plain")
  assert plain[3] < plain[0] - 1e-4                      # it trains
  for name, got in losses.items():
    np.testing.assert_allclose(got, plain, rtol=1e-5, err_msg=name)


def test_layouts_uneven_gives_device_0_the_smaller_share_and_branches_on_one_device():
  lay = peer.layouts(TINY)
  assert lay["even"].mlp.counts == (16,) * 4 and lay["even"].heads.counts == (2,) * 4
  for u in lay["uneven"].kinds().values():
    assert u.counts[0] < min(u.counts[1:]) and sum(u.counts) == u.num_units
  one = peer.layouts(peer.Settings(d_ff=64, heads=8, d_model=32, tensor=1, num_widths=3))
  assert one["uneven"].mlp.counts == (64,) and len(one["uneven"].mlp.widths) == 3


@pytest.mark.parametrize("change,flag", [
    (dict(precision=("float16",)), "--precision"),
    (dict(precision=("float32", "float32")), "--precision"),
    (dict(attention="flash"), "--attention"),
    (dict(attention="cudnn"), "--attention"),            # on a CPU
    (dict(heads=5), "--heads"),
    (dict(tensor=16), "--tensor"),
    (dict(tensor=8, heads=4, d_model=32), "--tensor"),
    (dict(tensor=3, batch=8), "--batch"),
    (dict(uneven=0.0), "--uneven"),
    (dict(num_widths=1), "--num_widths"),
    (dict(steps=0), "--steps"),
])
def test_bad_settings_name_their_flag(change, flag):
  s = dataclasses.replace(peer.Settings(), **change)
  with pytest.raises(peer.ConfigError, match=f"^{flag}: "):
    s.validate(device_count=8, backend="cpu")


@pytest.mark.slow
def test_bench_peer_smoke_run_on_8_cpu_devices(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_peer.py"),
                  "--precision=float32", "--precision=bfloat16", "--d_model=32", "--d_ff=64",
                  "--heads=8", "--layers=1", "--seq_len=16", "--batch=8", "--tensor=8",
                  "--steps=2", "--rounds=2", f"--out_dir={tmp_path}"],
                 check=True, env=env, cwd=ROOT, timeout=300, capture_output=True)
  with open(tmp_path / "bench_peer.json") as f:
    out = json.load(f)
  cells = {(c["precision"], c["program"]): c for c in out["cells"]}
  assert set(cells) == {(p, k) for p in peer.PRECISIONS for k in peer.PROGRAMS}
  for c in cells.values():
    assert len(c["round_ms"]) == 2 and 0 < c["min_ms"] <= c["median_ms"] <= c["max_ms"]
    assert c["tflops"] == pytest.approx(out["model_flops"] / c["median_ms"] / 1e9)
  assert out["rounds_done"] == 2
  for r in out["ratios"]:      # the median of the per-round ratios (2 rounds: their mean)
    p = r["precision"]
    for k in ("even", "uneven"):
      per_round = np.divide(cells[(p, k)]["round_ms"], cells[(p, "plain")]["round_ms"])
      assert r[f"{k}_over_plain"] == pytest.approx(np.mean(per_round))
  first = [cells[("float32", k)]["first_loss"] for k in peer.PROGRAMS]
  assert first == pytest.approx([first[0]] * 3, rel=1e-5)
  assert out["layouts"]["uneven"]["mlp"]["counts"][0] < out["layouts"]["uneven"]["mlp"][
      "counts"][1]
  assert (tmp_path / "bench_peer.md").read_text().startswith("| precision |")
  for (_, program), c in cells.items():   # tensor 8: each block's psums are all-reduces
    assert ("all_reduces" in c) == (program != "plain")
    assert program == "plain" or c["all_reduces"] > c["over_one_device"] >= 0


def test_bad_flag_is_one_line(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "bench_peer.py"),
                         "--precision=float32,float8", f"--out_dir={tmp_path}"],
                        env=env, cwd=ROOT, timeout=120, capture_output=True, text=True)
  assert done.returncode == 1
  assert done.stderr.strip().splitlines() == [
      "--precision: 'float8' is not one of ('float32', 'bfloat16')"]


def _gemms(jaxpr) -> collections.Counter:
  """{(lhs dtype, rhs dtype, out dtype, multiply-adds): count} of every dot_general in `jaxpr`
  and the jaxprs inside it (shard_map, custom_vjp, jit, cond branches, scan bodies)."""
  out = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_c, _), (lhs_b, _) = eqn.params["dimension_numbers"]
      lhs, rhs = (v.aval for v in eqn.invars)
      size = np.prod(eqn.outvars[0].aval.shape) * np.prod([lhs.shape[d] for d in lhs_c])
      out[(str(lhs.dtype), str(rhs.dtype), str(eqn.outvars[0].aval.dtype), int(size))] += 1
    for p in eqn.params.values():
      for q in (p if isinstance(p, (tuple, list)) else (p,)):
        inner = getattr(q, "jaxpr", q)
        if isinstance(inner, jax.extend.core.Jaxpr):
          out += _gemms(inner)
  return out


def test_semijax_even_bfloat16_step_runs_the_gemms_of_plain_jax():
  # On one device semijax's even step must do the matrix work of the plain step: every GEMM
  # of the forward and backward pass with the same size and the same operand and result dtypes
  # (a float32 GEMM where plain JAX has a bfloat16 one would run at half speed on a GPU).
  s = dataclasses.replace(TINY, tensor=1, d_model=64, d_ff=128, seq_len=32)
  semi, engine = peer.semijax_programs(s, "bfloat16", peer.batch(s))
  lay = peer.layouts(s)["even"]
  plan = engine.plan(lay, widths=plan_lib.uniform_widths(lay))
  state = engine.init(s.seed, lay)
  ours = _gemms(jax.make_jaxpr(engine.programs.train_step_fn)(
      state, engine.shard_batch(peer.batch(s)), plan).jaxpr)
  params = peer.plain_params(engine.logical_arrays(engine.init_logical(s.seed)).params)
  tx = optimizer_lib.make(optimizer_lib.OptimizerSpec(), peer.SCHEDULE_STEPS)
  plain = _gemms(jax.make_jaxpr(lambda p, o, b: plain_gpt.train_step(
      p, o, b, tx=tx, num_heads=s.heads, dtype=jnp.bfloat16, implementation="xla"))(
          params, tx.init(params), peer.batch(s)).jaxpr)
  # Per block q, k, v, out, two MLP GEMMs, scores and values; the head; forward and backward.
  assert sum(plain.values()) == 3 * (8 * s.layers + 1)
  assert ours == plain
  assert semi["even"].collectives == {"all_reduces": 0, "over_one_device": 0}
