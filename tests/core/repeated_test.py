"""A drained device skips the work every tensor device repeats (`core.repeated`).

  * under a plan that may drain, a toy head runs only on the busy devices (a debug callback
    records who ran it), and the loss and gradients are the dense ones, for any set of drained
    devices; under a plan that cannot drain, every device runs it;
  * likewise a toy stem (only busy devices embed), and a toy norm (only the devices that own
    units of the norm's kind run it);
  * in the engine, a layout compiled with the width 0 (the draining path) trains exactly like the
    same layout compiled without it: same loss and gradients.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import helpers as H
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib
from semijax.core import repeated
from flax import nnx

DATA, N = 2, 4


def _toy(counts, widths):
  """(loss, (dW, dx), devices that ran the head) of a toy head through `head_terms`."""
  mesh = mesh_lib.make_mesh(DATA, N)
  ran = []
  record = lambda i: ran.append(int(i))
  put = lambda a: mesh_lib.put(np.asarray(a, np.int32), mesh, P(mesh_lib.TENSOR))
  plan = plan_lib.Plan({"mlp": put(counts)}, (("mlp", widths),), idle=0 in counts)

  def head(x, w):
    jax.debug.callback(record, jax.lax.axis_index(mesh_lib.TENSOR))
    y = jnp.tanh(x @ w)
    return {"loss_sum": jnp.sum(y ** 2), "count": jnp.float32(y.size)}

  def local(x, w, plan):
    x = jnp.sin(x)                                 # replicated work before the head
    terms = repeated.head_terms(head, x, w, plan)
    return jax.lax.psum(terms, mesh_lib.DATA)

  def loss(w, x):
    terms = jax.shard_map(local, mesh=mesh, in_specs=(P(mesh_lib.DATA), P(), plan_lib.plan_specs(
        plan)), out_specs=P())(x, w, plan)
    return terms["loss_sum"] / terms["count"]

  w = jax.random.normal(jax.random.key(0), (8, 5))
  x = jax.random.normal(jax.random.key(1), (6, 8))
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(w, x)
  jax.effects_barrier()
  return value, grads, ran, (w, x)


@pytest.mark.parametrize("counts", [(2, 0, 1, 1), (0, 0, 0, 4), (1, 1, 1, 1)])
def test_only_busy_devices_run_the_head_and_the_gradients_are_dense(counts):
  value, grads, ran, (w, x) = _toy(counts, (0, 1, 2, 4))
  dense = lambda w, x: jnp.mean(jnp.tanh(jnp.sin(x) @ w) ** 2)
  ref_value, ref_grads = jax.value_and_grad(dense, argnums=(0, 1))(w, x)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
  busy = [d for d, c in enumerate(counts) if c > 0]
  assert sorted(ran) == sorted(busy * DATA)


def test_every_device_runs_the_head_under_a_plan_that_cannot_drain():
  _, _, ran, _ = _toy((2, 2, 2, 2), (1, 2, 4))
  assert sorted(ran) == sorted(list(range(N)) * DATA)


class _Scale(nnx.Module):
  """A toy norm: x * scale, recording (debug callback) which tensor device ran it."""

  def __init__(self, width: int, record):
    self.scale = nnx.Param(jnp.linspace(0.5, 1.5, width))
    self.record = record

  def __call__(self, x):
    jax.debug.callback(self.record, jax.lax.axis_index(mesh_lib.TENSOR))
    return x * self.scale[...]


def _toy_norm(counts, other, widths, which):
  """(loss, (d scale, dx), devices that ran it) of a toy norm of kind "mlp" through `normed`
  (which="norm") or `stem` (which="stem"); the loss weighs device d's sum of squares by its
  "mlp" count, so a device that skips the norm must add zeros."""
  mesh = mesh_lib.make_mesh(DATA, N)
  ran = []
  put = lambda a: mesh_lib.put(np.asarray(a, np.int32), mesh, P(mesh_lib.TENSOR))
  plan = plan_lib.Plan({"mlp": put(counts), "heads": put(other)},
                       (("mlp", widths), ("heads", widths)), idle=0 in counts + other)
  graphdef, state = nnx.split(_Scale(8, lambda i: ran.append(int(i))))

  def local(x, state, plan):
    if which == "norm":
      h = repeated.normed(nnx.merge(graphdef, state), x, plan, "mlp")
    else:
      h = repeated.stem(lambda x, s: nnx.merge(graphdef, s)(x), x, state, plan)
    c = plan.active["mlp"][0].astype(h.dtype)
    return jax.lax.psum(c * jnp.sum(h ** 2), (mesh_lib.DATA, mesh_lib.TENSOR))

  def loss(state, x):
    return jax.shard_map(local, mesh=mesh, in_specs=(P(mesh_lib.DATA), P(), plan_lib.plan_specs(
        plan)), out_specs=P())(x, state, plan)

  x = jax.random.normal(jax.random.key(1), (6, 8))
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(state, x)
  jax.effects_barrier()
  dense = lambda scale, x: sum(counts) * jnp.sum((x * scale) ** 2)
  ref_value, ref_grads = jax.value_and_grad(dense, argnums=(0, 1))(state["scale"][...], x)
  np.testing.assert_allclose(value, ref_value, rtol=1e-6)
  np.testing.assert_allclose(grads[0]["scale"][...], ref_grads[0], rtol=1e-5)
  np.testing.assert_allclose(grads[1], ref_grads[1], rtol=1e-5)
  return sorted(ran)


@pytest.mark.parametrize("counts,other", [((2, 0, 1, 1), (1, 1, 1, 1)),
                                          ((0, 0, 0, 4), (0, 2, 0, 2))])
def test_only_the_devices_owning_a_kind_run_its_norm(counts, other):
  ran = _toy_norm(counts, other, (0, 1, 2, 4), "norm")
  assert ran == sorted([d for d, c in enumerate(counts) if c > 0] * DATA)


@pytest.mark.parametrize("counts,other", [((2, 0, 1, 1), (1, 0, 1, 1)),
                                          ((0, 0, 0, 4), (0, 2, 0, 2))])
def test_only_busy_devices_run_the_stem(counts, other):
  ran = _toy_norm(counts, other, (0, 1, 2, 4), "stem")
  assert ran == sorted([d for d, (c, o) in enumerate(zip(counts, other)) if c + o > 0] * DATA)


def test_every_device_runs_the_norm_without_the_width_zero():
  assert _toy_norm((2, 2, 1, 1), (1, 1, 1, 1), (1, 2, 4), "norm") == sorted(list(range(N)) * DATA)


def test_the_draining_path_trains_like_the_plain_one():
  eng = H.make_engine("gpt", 1, N)
  counts = {"mlp": (20, 10, 10, 8), "heads": (3, 2, 2, 1)}
  capacity = {"mlp": 24, "heads": 4}

  def layout(zero):
    return L.Layout(**{k: L.UnitLayout.from_counts(
        k, c, capacity=capacity[k], widths=L.default_widths(capacity[k], 3, zero=zero))
        for k, c in counts.items()})

  state = eng.to_padded(eng.init_logical(0), layout(False))
  batch = eng.shard_batch(H.make_batch("gpt"))
  # Nobody owns nothing here: a bucket with the width 0 compiles no draining path unless the
  # plan says a device may be idle (as warm-up compiles it for a policy that may drain).
  assert not repeated.drains(eng.plan(layout(True)))
  plans = [eng.plan(layout(False)), eng.plan(layout(True)).with_idle()]
  assert [repeated.drains(p) for p in plans] == [False, True]
  (value, _), (drain_value, _) = [eng.loss(state.params, batch, p) for p in plans]
  grads = [jax.jit(jax.grad(lambda s, p: eng.loss(s, batch, p)[0]))(state.params, p)
           for p in plans]
  assert float(drain_value) == pytest.approx(float(value), rel=1e-6)
  H.assert_trees_close(grads[1], grads[0], atol=1e-6)


def _subjaxprs(eqn):
  """The jaxprs nested in one equation (none for a pallas kernel's body)."""
  if eqn.primitive.name == "pallas_call":
    return []
  subs = [v for v in eqn.params.values() for v in (v if isinstance(v, (tuple, list)) else (v,))]
  return [s for s in (getattr(v, "jaxpr", v) for v in subs) if hasattr(s, "eqns")]


def _walk(jaxpr, inside=False):
  """Yields (equation, whether it is in some cond's branch) of a jaxpr and its nested ones."""
  for eqn in jaxpr.eqns:
    yield eqn, inside
    for sub in _subjaxprs(eqn):
      yield from _walk(sub, inside or eqn.primitive.name == "cond")


def _softmax_conds(jaxpr) -> int:
  """How many conds hold an `exp` (a softmax) in a branch, outermost ones only."""
  count = 0
  for eqn, inside in _walk(jaxpr):
    if eqn.primitive.name == "cond" and not inside:
      count += any(e.primitive.name == "exp" for s in _subjaxprs(eqn) for e, _ in _walk(s))
  return count


def test_under_the_pallas_kernel_a_device_without_heads_skips_the_softmax_outside_the_kernels():
  # The pallas kernels run on every device (Pallas's interpreter synchronizes all devices per
  # call, and a GPU program gains nothing from skipping a kernel whose tiles are all skipped);
  # the attention scores and softmax over the C heads run in a cond, as do the embedding, the
  # norms and the head. Exactness: tests/core/drain_test.py's pallas case.
  eng = H.make_engine("gpt", 1, N, kernel="pallas")
  counts = {"mlp": (16, 16, 16, 0), "heads": (3, 3, 2, 0)}
  layout = L.Layout(**{k: L.UnitLayout.from_counts(
      k, c, capacity=c[0], widths=L.default_widths(c[0], 2, zero=True))
      for k, c in counts.items()})
  state = eng.to_padded(eng.init_logical(0), layout)
  batch = eng.shard_batch(H.make_batch("gpt"))

  def jaxpr(layout, params):
    plan = eng.plan(layout)
    assert plan.runs_pallas("heads")
    return repeated.drains(plan), jax.make_jaxpr(
        jax.grad(lambda p: eng.loss(p, batch, plan)[0]))(params).jaxpr

  drains, program = jaxpr(layout, state.params)
  assert drains
  in_cond = {e.primitive.name for e, inside in _walk(program) if inside}
  outside = {e.primitive.name for e, inside in _walk(program) if not inside}
  assert "pallas_call" in outside and "pallas_call" not in in_cond
  # The head's softmax and each layer's attention (their backward passes keep the
  # probabilities).
  assert _softmax_conds(program) == 1 + H.GPT_KW["num_layers"]
  # Under an even split nothing is skipped: no cond at all.
  even = L.Layout.for_model(d_model=H.GPT_KW["d_model"], num_heads=H.GPT_KW["num_heads"],
                            d_ff=H.GPT_KW["d_ff"], num_devices=N)
  drains, program = jaxpr(even, eng.to_padded(eng.init_logical(0), even).params)
  assert not drains and not any(e.primitive.name == "cond" for e, _ in _walk(program))
  # Nor in a bucket that compiles the width 0 while every device owns units (the conds would
  # cost every step, drained device or not); warm-up compiles the idle variant beside it.
  busy = L.Layout(**{k: L.UnitLayout.from_counts(
      k, c, capacity=16 if k == "mlp" else 3, widths=L.default_widths(16 if k == "mlp" else 3, 2,
                                                                      zero=True))
      for k, c in {"mlp": (13, 12, 12, 11), "heads": (2, 2, 2, 2)}.items()})
  drains, program = jaxpr(busy, eng.to_padded(eng.init_logical(0), busy).params)
  assert not drains and not any(e.primitive.name == "cond" for e, _ in _walk(program))
