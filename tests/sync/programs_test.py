"""The replica programs against a dense single-device reference (tests/dense_reference.py).

ssaw on emulated replicas: gradients computed on the parameters of the version a replica started
on, applied rounds later with `weights.combine`'s weights and learning-rate scale, must be what
a plain loop computes with the reference model, a history of parameter versions and optax. Local
SGD with DiLoCo's outer Nesterov step likewise, on an uneven random layout.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dense_reference as ref
import helpers as H
from semijax.core import engine as engine_lib
from semijax.sync import inflight
from semijax.sync import programs as programs_lib
from semijax.sync import rounds as rounds_lib
from semijax.sync import settings as settings_lib
from semijax.sync import weights

R, M = 4, 2            # replicas (mesh.data), samples per microbatch
LR = 3e-3


def microbatches(n):
  return [H.make_batch("gpt", seed=200 + j, batch_size=M) for j in range(n)]


def concat(batches):
  return jax.tree.map(lambda *x: np.concatenate(x), *batches)


def logical_params(eng, padded, layout):
  return inflight.to_logical(padded, eng.axes, layout, eng.unit_sizes, leading=0)


def close_to_reference(eng, padded, layout, ref_params):
  # The key bias has no true gradient (a shift shared by all keys), so Adam turns round-off
  # into full steps on it: left out, as in tests/models/model_test.py.
  drop_bk = lambda t: jax.tree_util.tree_map_with_path(
      lambda p, x: None if "bk" in jax.tree_util.keystr(p) else x, t)
  H.assert_trees_close(drop_bk(logical_params(eng, padded, layout)),
                       drop_bk(ref.from_reference(ref_params)), atol=2e-5, rtol=1e-4)


@pytest.fixture(scope="module")
def setup():
  tx = optax.adamw(LR, weight_decay=0.1)
  eng = H.make_engine("gpt", data=R, tensor=2, tx=tx)
  layout = H.random_layout(3, 2)
  logical = eng.init_logical(0)
  logical_np = logical_params(eng, eng.to_padded(logical, layout).params, layout)
  _, ref_params, ref_loss = H.reference_loss_fn("gpt", logical_np)
  grad = jax.jit(jax.grad(lambda p, b: ref_loss(p, b)[0]))
  return dict(tx=tx, eng=eng, layout=layout, logical=logical, ref_params=ref_params, grad=grad)


def test_ssaw_rounds_match_a_reference_with_stale_gradients(setup):
  eng, layout, tx = setup["eng"], setup["layout"], setup["tx"]
  settings = settings_lib.SyncSettings(mode="ssaw")
  steps = 4
  mbs = microbatches(steps * R)
  state = eng.to_padded(setup["logical"], layout)
  plan = eng.plan(layout)
  runner = rounds_lib.RoundRunner(eng, settings, batch_size=R * M, total_microbatches=steps * R,
                                  learning_rate=lambda progress: LR)
  runner.bind(state)
  durations = [1.0, 1.0, 2.5, 1.0]
  gb = lambda k: concat(mbs[k * R:(k + 1) * R])
  runner.start(state, plan, mbs.__getitem__, durations)
  results = []
  while not runner.done:
    state, res = runner.round(state, plan, mbs.__getitem__, gb, durations)
    results.append(res)
  rounds = [r.round for r in results]
  assert max(s for r in rounds for s in r.staleness) >= 2          # really stale gradients
  assert sorted(j for r in rounds for j in r.microbatches) == list(range(steps * R))

  history = {0: setup["ref_params"]}
  params, opt = setup["ref_params"], tx.init(setup["ref_params"])
  for res in results:
    rnd = res.round
    grads = [setup["grad"](history[rnd.version - 1 - s], mbs[j])
             for j, s in zip(rnd.microbatches, rnd.staleness)]
    comb = weights.combine(rnd.samples, rnd.staleness, R * M, settings)
    assert res.lr_scale == pytest.approx(comb.lr_scale)
    g = jax.tree.map(lambda *x: sum(w * xi for w, xi in zip(comb.weights, x)), *grads)
    updates, opt = tx.update(g, opt, params)
    params = optax.apply_updates(params, jax.tree.map(lambda u: u * comb.lr_scale, updates))
    history[rnd.version] = params
  close_to_reference(eng, state.params, layout, params)


def test_local_sgd_with_diloco_outer_steps_matches_a_reference(setup):
  eng, layout, tx = setup["eng"], setup["layout"], setup["tx"]
  settings = settings_lib.SyncSettings(mode="local_sgd", local_steps=2, outer="nesterov")
  progs = programs_lib.Programs(eng, settings)
  state = eng.to_padded(setup["logical"], layout)
  plan = eng.plan(layout)
  progs.bind(state)
  mbs = microbatches(4 * R)
  replicas = progs.stack(state)
  params = state.params
  momentum = jax.tree.map(jnp.zeros_like, params)
  for k in range(4):
    replicas, _ = progs.local(replicas, eng.shard_batch(concat(mbs[k * R:(k + 1) * R])), plan)
    if (k + 1) % 2 == 0:
      params, replicas, momentum = progs.outer(params, replicas, momentum)

  g_params = setup["ref_params"]
  g_mom = jax.tree.map(jnp.zeros_like, g_params)
  local = [(g_params, tx.init(g_params)) for _ in range(R)]
  for k in range(4):
    for r in range(R):
      p, o = local[r]
      u, o = tx.update(setup["grad"](p, mbs[k * R + r]), o, p)
      local[r] = (optax.apply_updates(p, u), o)
    if (k + 1) % 2 == 0:
      mean = jax.tree.map(lambda *x: sum(x) / R, *[p for p, _ in local])
      delta = jax.tree.map(jnp.subtract, g_params, mean)
      g_mom = jax.tree.map(lambda m, d: 0.9 * m + d, g_mom, delta)
      g_params = jax.tree.map(lambda p, d, m: p - 0.7 * (d + 0.9 * m), g_params, delta, g_mom)
      local = [(g_params, o) for _, o in local]
  close_to_reference(eng, params, layout, g_params)
  for r in range(R):          # every replica restarts from the global model
    mine = jax.tree.map(lambda x, r=r: x[r], replicas.params)
    close_to_reference(eng, mine, layout, g_params)


def test_in_flight_state_round_trips_through_the_logical_form(setup):
  eng, layout = setup["eng"], setup["layout"]
  other = H.random_layout(11, 2)
  state = eng.to_padded(setup["logical"], layout)
  stacked = jax.device_get(programs_lib.Programs(eng, settings_lib.SyncSettings()).bind(
      state).stack(state))
  logical = inflight.state_to_logical(stacked, eng.tx, eng.axes, layout, eng.unit_sizes)
  params, opt = inflight.state_to_padded(logical, eng.tx, eng.axes, other, eng.unit_sizes)
  back = inflight.state_to_logical(engine_lib.TrainState(params, opt), eng.tx, eng.axes, other,
                                   eng.unit_sizes)
  H.assert_trees_close(back, logical, atol=0)
  for kind, names, owned, padding in H.split_slots(eng, jax.tree.map(lambda x: x[1], params),
                                                   other):
    assert np.all(padding == 0), (kind, names)
