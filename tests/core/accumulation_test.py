"""Gradient accumulation (`gradient_accumulation_steps`, `StepFunctions.grads_and_terms`): a step
over K microbatches is the step over the whole batch, against the dense reference."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dense_reference as ref
import helpers as H


def _weighted_batch(seed, batch_size):
  """A GPT batch whose rows carry different token weights (a padded corpus), so that the
  microbatches' token counts differ and a mean of microbatch means would be wrong."""
  batch = H.make_batch("gpt", seed=seed, batch_size=batch_size)
  rng = np.random.default_rng(seed)
  weights = (rng.random(batch["targets"].shape) < 0.7).astype(np.float32)
  weights[: batch_size // 2] = 1.0
  return dict(batch, weights=weights)


def _all_reduces(jaxpr, in_loop=False, out=None) -> list:
  """(inside a scan?, reduced mesh axes) of every all-reduce in `jaxpr`, nested ones too."""
  out = [] if out is None else out
  for e in jaxpr.eqns:
    if e.primitive.name.startswith("psum"):
      out.append((in_loop, tuple(e.params["axes"])))
    for value in e.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if hasattr(getattr(sub, "jaxpr", sub), "eqns"):
          _all_reduces(getattr(sub, "jaxpr", sub), in_loop or e.primitive.name == "scan", out)
  return out


def test_gradients_cross_data_once_a_step_not_once_a_microbatch():
  eng = H.make_engine("gpt", data=2, tensor=4, accumulation=3)
  layout = H.random_layout(3, 4)
  state = eng.to_padded(eng.init_logical(0), layout)
  batch = eng.shard_batch(H.make_batch("gpt", seed=1, batch_size=12))
  reduces = _all_reduces(jax.make_jaxpr(eng.steps.train_step)(state, batch, eng.plan(layout)).jaxpr)
  in_loop = {axes for loop, axes in reduces if loop}
  assert in_loop and all("data" not in axes for axes in in_loop), in_loop   # tensor ones only
  assert any(not loop and "data" in axes for loop, axes in reduces)
  micro = eng.steps.microbatches({"rows": np.arange(6), "pairs": np.ones((6, 2))})
  assert micro["rows"].tolist() == [[0, 1], [2, 3], [4, 5]] and micro["pairs"].shape == (3, 2, 2)
  with pytest.raises(ValueError, match="gradient_accumulation_steps: a data shard's 5 rows"):
    eng.steps.microbatches({"rows": np.arange(5)})


@pytest.mark.parametrize("accumulation", [2, 4])
def test_accumulated_steps_match_the_dense_reference_on_the_whole_batch(accumulation):
  tx = optax.adamw(3e-3, weight_decay=0.1)
  eng = H.make_engine("gpt", data=2, tensor=4, tx=tx, accumulation=accumulation)
  layout = H.random_layout(3, 4)
  logical = eng.init_logical(0)
  state, plan = eng.to_padded(logical, layout), eng.plan(layout)
  _, ref_params, ref_loss = H.reference_loss_fn("gpt", logical.params)
  ref_opt = tx.init(ref_params)

  def weighted_loss(p, batch):
    _, logits = ref_loss(p, batch)
    logp = jax.nn.log_softmax(logits)
    nll = -jnp.take_along_axis(logp, batch["targets"][..., None], -1)[..., 0]
    return (nll * batch["weights"]).sum() / batch["weights"].sum()

  @jax.jit
  def ref_step(p, o, batch):
    loss, g = jax.value_and_grad(weighted_loss)(p, batch)
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o, loss

  for step in range(3):
    batch = _weighted_batch(200 + step, batch_size=8)
    state, metrics = eng.train_step(state, eng.shard_batch(batch), plan)
    ref_params, ref_opt, ref_l = ref_step(ref_params, ref_opt, batch)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_l), rtol=1e-5)
  # The key bias has no true gradient (see model_test), so Adam amplifies round-off on it.
  drop_bk = lambda t: jax.tree_util.tree_map_with_path(
      lambda p, x: None if "bk" in jax.tree_util.keystr(p) else x, t)
  final = eng.to_logical(state, layout)
  H.assert_trees_close(drop_bk(final.params), drop_bk(ref.from_reference(ref_params)),
                       atol=1e-4, rtol=1e-4)



def test_accumulation_shrinks_the_step_temporaries():
  """The point of accumulating: a step holds one microbatch's activations at a time, so XLA's
  memory analysis of the compiled step (per device) shows fewer temporary bytes."""
  temps = {}
  for k in (1, 4):
    eng = H.make_engine("gpt", data=1, tensor=4, accumulation=k)
    layout = H.even_layout(4)
    state = eng.to_padded(eng.init_logical(0), layout)
    batch = eng.shard_batch(H.make_batch("gpt", seed=1, batch_size=64))
    compiled = eng.programs.compiled_fn("train", state, batch, eng.plan(layout))
    temps[k] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[4] < 0.5 * temps[1], temps


def test_each_replica_accumulates_its_own_mean_gradient():
  """The replica modes' gradients (`replica_grads_and_terms`): each data replica's mean over
  its own rows, from 2 microbatches of unequal token counts, equal to the one-pass ones."""
  engines = [H.make_engine("gpt", data=2, tensor=4, accumulation=k) for k in (1, 2)]
  layout = H.random_layout(4, 4)
  params = engines[0].to_padded(engines[0].init_logical(0), layout).params
  stacked = jax.tree.map(lambda x: jnp.stack([x, 1.5 * x]), params)   # two replicas' own
  batch = engines[0].shard_batch(_weighted_batch(9, batch_size=8))
  (g1, t1), (g2, t2) = [jax.jit(e.replica_grads_and_terms)(stacked, batch, e.plan(layout))
                        for e in engines]
  np.testing.assert_allclose(np.asarray(t2["loss_sum"]), np.asarray(t1["loss_sum"]), rtol=1e-6)
  assert not np.allclose(np.asarray(t1["count"])[0], np.asarray(t1["count"])[1])
  H.assert_trees_close(g2, g1, atol=1e-6, rtol=1e-5)
