"""Rematerialization (`config.model.remat_policy`, `core.remat`): what a training step keeps for
its backward pass. (That it computes the same numbers is checked against the dense reference in
model_test and llama_test.)"""

import contextlib
import io
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

import helpers as H
from semijax import models
from semijax.core import layout as L
from semijax.core import precision as precision_lib
from semijax.core import remat
from semijax.errors import ConfigError

def residuals(policy: str) -> list:
  """The element counts of the arrays the loss's backward pass keeps (global shapes), for a GPT
  of 3 blocks on an uneven layout over 4 tensor devices."""
  precision = precision_lib.Precision(remat_policy=policy)
  eng = H.make_engine("gpt", 1, 4, precision=precision)
  kw = H.GPT_KW
  rng = np.random.default_rng(3)
  layout = L.Layout(mlp=H.random_unit_layout(rng, "mlp", kw["d_ff"], 4),
                    heads=H.random_unit_layout(rng, "heads", kw["num_heads"], 4))
  params = eng.to_padded(eng.init_logical(0), layout).params
  batch = eng.shard_batch(H.make_batch("gpt", seed=1, batch_size=8))
  plan = eng.plan(layout)
  out = io.StringIO()
  with contextlib.redirect_stdout(out):    # one line a residual: "f32[4,8,32] output of ..."
    jax.ad_checkpoint.print_saved_residuals(lambda p: eng.loss(p, batch, plan)[0], params)
  lines = [line for line in out.getvalue().splitlines() if "from the argument" not in line]
  shapes = [re.match(r"\w+\[([\d,]*)\]", line).group(1) for line in lines]
  assert len(shapes) > 5
  return [math.prod(int(n) for n in s.split(",") if n) for s in shapes]


def test_full_remat_keeps_only_block_inputs():
  """"full" keeps nothing of a block wider than its input [batch, seq, d_model] (the widest
  array it keeps is the head's logits [batch, seq, vocab]): not the MLP's hidden units or the
  attention heads (their global shapes stack the 4 devices' padded blocks), which "none" keeps;
  "minimal" keeps less than "none" and more than "full"."""
  kw = H.GPT_KW
  logits = 8 * kw["seq_len"] * max(kw["d_model"], kw["vocab_size"])
  kept = {p: residuals(p) for p in precision_lib.remat.POLICIES}
  assert max(kept["none"]) > logits
  assert max(kept["full"]) <= logits
  total = {p: sum(sizes) for p, sizes in kept.items()}
  assert total["full"] < 0.5 * total["none"], total
  assert total["full"] < total["minimal"] < total["none"], total


def test_a_bad_policy_is_refused_naming_the_field():
  with pytest.raises(ValueError, match="model.remat_policy: 'full' with layout.kernel 'pallas' "
                                       "needs a GPU or TPU"):
    H.make_engine("gpt", 1, 4, precision=precision_lib.Precision(remat_policy="full"),
                  kernel="pallas")
  remat.check("full", "pallas", "gpu")
  remat.check("full", "auto", "cpu")                 # auto: the switch kernel on CPU
  with pytest.raises(ConfigError, match="config.model.remat_policy: 'all' is not one of"):
    models.spec("gpt", dict(H.GPT_KW, remat_policy="all"))
  spec = models.spec("gpt", dict(H.GPT_KW, remat_policy="full"))
  assert spec.precision.remat_policy == "full"
  assert "remat_policy" not in spec.to_dict()      # a checkpoint does not record it
  assert models.build(spec)[0](nnx.Rngs(0)).encoder.remat_policy == "full"
