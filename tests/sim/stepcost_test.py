"""The step model against an independent loop-by-loop computation of the same formulas, and the
workload's counts against the real engine."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

from helpers import GPT_KW, make_engine
from semijax.core import engine as engine_lib
from semijax.core import mesh as mesh_lib
from semijax.core.precision import Precision
from semijax.errors import ConfigError
from semijax.models import gpt, tasks
from semijax.sim import cluster as cluster_lib
from semijax.sim import hardware
from semijax.sim import stepcost
from semijax.sim import strategies
from semijax.sim import workload as workload_lib
from semijax.sync import predict

HW = hardware.Hardware(
    "t", device_flops=1e12, branch_overhead=0.25, resize_overhead=0.5, offload_overhead=0.75,
    step_overhead_s=0.003, memory_bytes_per_s=1e11,
    links={"tensor": hardware.Link(1e-5, 1e11), "pipe": hardware.Link(2e-5, 1e10),
           "data": hardware.Link(3e-5, 1e10), "region": hardware.Link(1e-3, 1e9)})


def small_workload(microbatches=2, **kw):
  return workload_lib.Workload.gpt(d_model=64, num_heads=4, d_ff=96, num_layers=4, seq_len=16,
                                   vocab_size=50, batch_per_replica=4, microbatches=microbatches,
                                   **kw)


# {name: (precision and mu_dtype of the workload, bytes of (an activation, a gradient, the state
# of a parameter: itself and Adam's two moments))}, the bytes by hand.
PRECISIONS = {
    "float32": ({}, (4, 4, 12)),
    "bf16_compute": ({"precision": Precision(dtype="bfloat16")}, (2, 4, 12)),
    "bf16": ({"precision": Precision(dtype="bfloat16", param_dtype="bfloat16")}, (2, 2, 6)),
    "bf16_mu32": ({"precision": Precision(dtype="bfloat16", param_dtype="bfloat16"),
                   "mu_dtype": "float32"}, (2, 2, 8)),
}


def reference_step(w, c, hw, widths, kinds, speeds, links, nbytes=(4, 4, 12)):
  """The module doc's formulas, written out with loops and nothing from `stepcost`; `nbytes`:
  (activation, gradient, state) bytes per value."""
  act_b, grad_b, state_b = nbytes
  spec = w.spec
  tokens = w.batch_per_replica * spec.seq_len // w.microbatches
  flops = {k: 3.0 * f for k, f in spec.flops_per_unit().items()}
  layers = [spec.num_layers // c.pipe] * c.pipe
  d = spec.d_model
  ring = lambda link, b, n: 0.0 if n == 1 else (2 * (n - 1) * link.latency_s
                                                + 2 * (n - 1) / n * b / link.bytes_per_s)
  act = tokens * d * act_b
  factor = {"single": 1.0, "branched": 1 + hw.branch_overhead, "resized": 1 + hw.resize_overhead,
            "offload": 1 + hw.offload_overhead}
  replicas = []
  for r in range(c.data):
    taus, updates = [], []
    for s in range(c.pipe):
      tau = 0.0
      for l in range(layers[s]):
        for k in ("mlp", "heads"):
          tau += factor[kinds[s]] * max(flops[k] * tokens * widths[k][s, t, l] / hw.device_flops
                                        / speeds[r, s, t] for t in range(c.tensor))
        tau += 2 * ring(hw.link("tensor"), act, c.tensor)
      rep = layers[s] * 3 * 16 * d * tokens
      if s == c.pipe - 1:
        rep += 3 * (8 * d + 2 * d * w.vocab_size + 5 * w.vocab_size) * tokens
      slowest = min(speeds[r, s, t] for t in range(c.tensor))
      tau += rep / hw.device_flops / slowest
      if s < c.pipe - 1:
        tau += 2 * (hw.link("pipe").latency_s + act / hw.link("pipe").bytes_per_s)
      taus.append(tau)
      unit = (2 * d + 1) * spec.d_ff + (4 * d * spec.head_dim + 3 * spec.head_dim) * spec.num_heads
      params = layers[s] * (unit / c.tensor + 6 * d)
      params += (w.vocab_size + spec.seq_len) * d if s == 0 else 0
      params += (2 * d + d * w.vocab_size) if s == c.pipe - 1 else 0
      updates.append(2 * state_b * params / hw.memory_bytes_per_s / slowest)
    pipeline = sum(taus) + (w.microbatches - 1) * max(taus)
    replicas.append(pipeline + max(updates) + hw.step_overhead_s)
  grad = grad_b * max(
      layers[s] * (((2 * d + 1) * spec.d_ff + (4 * d * spec.head_dim + 3 * spec.head_dim)
                    * spec.num_heads) / c.tensor + 6 * d)
      + ((w.vocab_size + spec.seq_len) * d if s == 0 else 0)
      + ((2 * d + d * w.vocab_size) if s == c.pipe - 1 else 0) for s in range(c.pipe))
  if c.regions == 1:
    sync = ring(hw.link("data"), grad, c.data)
  else:
    slowest = hardware.Link(max(hw.link("region").latency_s, hw.link("data").latency_s),
                            min(hw.link("region").bytes_per_s * min(links),
                                hw.link("data").bytes_per_s))
    sync = ring(slowest, grad, c.data)
  return max(replicas) + sync


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("data, pipe, regions", [(1, 1, 1), (3, 2, 1), (4, 2, 2)])
def test_step_matches_the_loop_reference(data, pipe, regions, precision):
  rng = np.random.default_rng(data * 10 + pipe)
  kw, nbytes = PRECISIONS[precision]
  w = small_workload(**kw)
  c = cluster_lib.Cluster(data, pipe, 4, regions)
  model = stepcost.StepModel(w, c, HW, strategies.make("sync"))
  widths = {k: rng.integers(1, 30, (pipe, 4, 4 // pipe)).astype(float) for k in ("mlp", "heads")}
  kinds = ["branched", "single"][:pipe] if pipe > 1 else ["resized"]
  speeds = rng.uniform(0.2, 1.0, (data, pipe, 4))
  links = np.array([0.3, 1.0])[:regions]
  got = model.step(widths, kinds, speeds, links).seconds
  want = reference_step(w, c, HW, widths, kinds, speeds, links, nbytes)
  assert got == pytest.approx(want, rel=1e-9)


def test_a_slow_device_slows_its_blocks_and_the_repeated_work_only():
  w = small_workload(1)
  c = cluster_lib.Cluster(1, 1, 4)
  model = stepcost.StepModel(w, c, HW, strategies.make("sync"))
  widths = {"mlp": np.full((1, 4, 4), 24.0), "heads": np.full((1, 4, 4), 1.0)}
  fast = model.step(widths, ["single"], np.ones((1, 1, 4)), np.ones(1)).seconds
  slow = model.step(widths, ["single"], np.array([[[1, 1, 0.5, 1]]]), np.ones(1)).seconds
  blocks = model.block_seconds(widths, np.ones((1, 1, 4)))[0, 0]
  scaled = blocks + model.repeated_s[0] + model.update_s[0]
  assert slow - fast == pytest.approx(scaled, rel=1e-9)            # exactly those, twice as long


@pytest.mark.parametrize("cores", [0, 2])
def test_a_drained_devices_speed_leaves_the_step(cores):
  # Device 2 owns nothing (a drained device): no blocks, no repeated work, no update, no wait.
  # Its speed 0.01 then costs nothing, and on shared cores its copy of the repeated work and the
  # update takes no turn: 3 busy devices on 2 cores, against 4 before.
  w = small_workload(1)
  c = cluster_lib.Cluster(2, 1, 4)
  hw = dataclasses.replace(HW, cores=cores, contention_wait_s=0.02)
  model = stepcost.StepModel(w, c, hw, strategies.make("sync"))
  drained = {"mlp": np.array([[[32.0] * 4] * 2 + [[0.0] * 4] + [[32.0] * 4]]),
             "heads": np.array([[[2.0] * 4] * 2 + [[0.0] * 4] + [[2.0] * 4]])}
  speeds = np.ones((2, 1, 4))
  failing = speeds.copy()
  failing[1, 0, 2] = 0.01
  full = model.step(drained, ["branched"], speeds, np.ones(1))
  assert model.step(drained, ["branched"], failing, np.ones(1)).seconds == full.seconds
  assert stepcost.busy_devices(drained).tolist() == [[True, True, False, True]]
  assert model.core_share(stepcost.busy_devices(drained)).tolist() == [1.5 if cores else 1.0]
  # The same work with device 2 keeping one unit of each kind: its speed counts again.
  kept = {k: v.copy() for k, v in drained.items()}
  kept["mlp"][0, 2], kept["heads"][0, 2] = 1.0, 1.0
  slow = model.step(kept, ["branched"], failing, np.ones(1)).seconds
  assert slow > 5 * model.step(kept, ["branched"], speeds, np.ones(1)).seconds
  # Nobody drained: every device busy, the model as before (4 devices on 2 cores: 2 turns).
  assert model.core_share(np.ones((1, 4), bool)).tolist() == [2.0 if cores else 1.0]


def test_repeated_steps_reuse_their_terms_and_still_call_the_strategy():
  # `step` keeps the replica times of inputs it has seen: equal to a fresh model's, keyed by
  # value (an array changed in place is new input), and the strategy still sees every step.
  rng = np.random.default_rng(7)
  w = small_workload()
  c = cluster_lib.Cluster(3, 2, 4)
  model = stepcost.StepModel(w, c, HW, strategies.make("ssaw"))
  widths = {k: rng.integers(1, 30, (2, 4, 2)).astype(float) for k in ("mlp", "heads")}
  speeds = rng.uniform(0.2, 1.0, (3, 2, 4))
  fresh = lambda: stepcost.StepModel(w, c, HW, strategies.make("ssaw")).step(
      widths, ["branched", "single"], speeds, np.ones(1))
  first = model.step(widths, ["branched", "single"], speeds, np.ones(1))
  again = model.step(widths, ["branched", "single"], speeds, np.ones(1))
  assert again.seconds == first.seconds == fresh().seconds
  np.testing.assert_array_equal(again.features, fresh().features)
  assert len(model.strategy.staleness) == 2 and len(model._memo) == 1
  widths["mlp"][0, 1, 0] += 5.0                                   # in place: another step
  speeds[1, 0, 2] = 0.1
  moved = model.step(widths, ["branched", "single"], speeds, np.ones(1))
  assert moved.seconds == fresh().seconds != first.seconds
  assert len(model._memo) == 2
  with pytest.raises(ValueError):
    moved.features[0] = 0.0                                       # shared: read-only


def test_shared_cores_charge_the_summed_work():
  w = small_workload(1)
  c = cluster_lib.Cluster(1, 1, 4)
  shared = hardware.Hardware("s", device_flops=1e12, cores=2)
  model = stepcost.StepModel(w, c, shared, strategies.make("sync"))
  widths = {"mlp": np.full((1, 4, 4), 24.0), "heads": np.full((1, 4, 4), 1.0)}
  own = stepcost.StepModel(w, c, hardware.Hardware("o", device_flops=1e12),
                           strategies.make("sync"))
  ratio = (model.block_seconds(widths, np.ones((1, 1, 4)))
           / own.block_seconds(widths, np.ones((1, 1, 4))))
  assert ratio[0, 0] == pytest.approx(2.0)                          # 4 devices on 2 cores


def test_unknown_strategies_are_refused():
  # The planner is in the library now (the study's `planner` column), not a strategy.
  assert "planner" not in strategies.PENDING
  with pytest.raises(ConfigError, match=r"'planner' is not one of \['sync'") as e:
    strategies.make("planner")
  assert "not in the library" not in str(e.value)


def test_ssaw_is_the_librarys_predictor_and_scales_with_time():
  # One replica 2.5x slower: sync waits for it; ssaw's rounds do not (semijax.sync.predict).
  replicas = np.array([2.5, 1.0, 1.0, 1.0])
  sync_s, _ = strategies.make("sync").combine(replicas, 0.1)
  ssaw = strategies.make("ssaw")
  ssaw_s, _ = ssaw.combine(replicas, 0.1)
  want = predict.predict("ssaw", replicas, comm_s=0.1).batch_s
  assert sync_s == pytest.approx(2.6) and ssaw_s == pytest.approx(want, rel=1e-3)
  assert ssaw_s < 0.8 * sync_s
  assert ssaw.combine(3 * replicas, 0.3)[0] == pytest.approx(3 * ssaw_s, rel=1e-3)
  even = strategies.make("ssaw").combine(np.ones(4), 0.1)[0]      # equal speeds: synchronous
  assert even == pytest.approx(1.1, rel=1e-3)


def test_workload_counts_match_the_real_engine():
  eng = make_engine("gpt")
  w = workload_lib.Workload.gpt(**GPT_KW, batch_per_replica=4)
  assert w.unit_bytes() == pytest.approx(eng.unit_bytes())
  total = sum(int(np.prod(s)) for s in jax.tree.leaves(
      eng.logical_shapes, is_leaf=lambda x: isinstance(x, tuple)))
  spec = w.spec
  units = sum(w.unit_params()[k] * u for k, u in spec.num_units().items())
  mine = (spec.num_layers * (units + w.layer_repeated_params()) + sum(w.edge_params().values()))
  assert mine == total
  # Forward + backward (3x the forward) FLOPs a token, counted by hand for d_model 32, 8 heads
  # of 4, seq_len 8 (causal), vocabulary 64: an MLP unit 2 GEMMs x 2 x 32; a head 4 GEMMs x 2 x
  # 32 x 4 plus scores and values 2 x 2 x 8 x 4 / 2; a block's two LayerNorms 2 x 8 x 32; the
  # final norm 8 x 32, the head 2 x 32 x 64 and the loss 5 x 64.
  assert w.unit_flops() == pytest.approx({"mlp": 3 * 128, "heads": 3 * (1024 + 64)})
  assert w.layer_repeated_flops() == pytest.approx(3 * 512)
  assert w.last_flops() == pytest.approx(3 * (256 + 4096 + 320))


def test_half_precision_halves_what_it_stores_and_sends():
  """Without latencies: bfloat16 activations halve the tensor all-reduce, the boundary transfer
  and the weights offloading sends; bfloat16 storage the gradient all-reduce and the update."""
  free = hardware.Hardware("f", device_flops=1e12, memory_bytes_per_s=1e11,
                           links={k: hardware.Link(0.0, 1e10) for k in hardware.LEVELS})
  c = cluster_lib.Cluster(2, 2, 4)
  model = {k: stepcost.StepModel(small_workload(**kw), c, free, strategies.make("sync"))
           for k, (kw, _) in PRECISIONS.items()}
  f32, compute, half = model["float32"], model["bf16_compute"], model["bf16"]
  assert f32.allreduce_s > 0 and f32.boundary_s[0] > 0
  assert compute.allreduce_s == pytest.approx(f32.allreduce_s / 2)
  np.testing.assert_allclose(compute.boundary_s, f32.boundary_s / 2)
  w32, w16 = f32.workload, compute.workload
  assert w16.unit_bytes() == pytest.approx({k: b / 2 for k, b in w32.unit_bytes().items()})
  assert compute.gradient_bytes() == f32.gradient_bytes()
  np.testing.assert_array_equal(compute.update_s, f32.update_s)
  assert half.gradient_bytes() == f32.gradient_bytes() / 2
  np.testing.assert_allclose(half.update_s, f32.update_s / 2)
  np.testing.assert_allclose(model["bf16_mu32"].update_s, f32.update_s * 8 / 12)
  with pytest.raises(ConfigError, match="sim.workload.mu_dtype"):
    small_workload(mu_dtype="int8")


@pytest.mark.parametrize("precision", [Precision(), Precision(dtype="bfloat16"),
                                       Precision(dtype="bfloat16", param_dtype="bfloat16")])
def test_offloaded_unit_bytes_are_the_engines_in_each_precision(precision):
  mesh = mesh_lib.make_mesh(1, 8)
  eng = engine_lib.Engine(lambda rngs: gpt.GPT(rngs=rngs, precision=precision, **GPT_KW),
                          tasks.language_model, mesh, optax.adamw(1e-2))
  w = workload_lib.Workload.gpt(**GPT_KW, batch_per_replica=4, precision=precision)
  assert w.unit_bytes() == pytest.approx(eng.unit_bytes())
  assert w.unit_bytes()["mlp"] == precision.compute_bytes * (2 * 32 + 1) * 2    # 2 layers


def test_devices_sharing_cores_speed_up_while_full_speed_partners_wait():
  # Two full-speed devices: the short one ends at 1 s, the long one then computes at 2x.
  per = np.array([[3.0], [1.0]])                                    # [T, L] seconds
  free = np.array([[True], [True]])
  assert stepcost.shared_finish(per, free, 2.0) == pytest.approx([1.0 + 2.0 / 2.0])
  assert stepcost.shared_finish(per, free, 1.5) == pytest.approx([1.0 + 2.0 / 1.5])
  assert stepcost.shared_finish(per, free, 1.0) == pytest.approx([3.0])
  # A contended partner leaves its core to the competitor: no speed-up.
  assert stepcost.shared_finish(per, np.array([[True], [False]]), 2.0) == pytest.approx([3.0])
  # Three full-speed devices (works 1, 2, 4), at most 2x: rates 1, 1.5, 2 as they end.
  per3 = np.array([[4.0], [1.0], [2.0]])
  want = 1.0 + (2.0 - 1.0) / 1.5 + (4.0 - 2.0) / 2.0
  assert stepcost.shared_finish(per3, np.ones((3, 1), bool), 2.0) == pytest.approx([want])


def test_the_features_give_the_step_with_an_idle_speedup_and_a_contention_wait():
  w = small_workload(1)
  c = cluster_lib.Cluster(1, 1, 2)
  hw = hardware.Hardware("h", device_flops=1e12, branch_overhead=0.25, step_overhead_s=0.003,
                         idle_speedup=1.6, contention_wait_s=0.02)
  widths = {"mlp": np.array([[[70.0] * 4, [26.0] * 4]]), "heads": np.array([[[3.0] * 4,
                                                                             [1.0] * 4]])}
  for speeds in (np.ones((1, 1, 2)), np.array([[[1.0, 0.4]]])):
    model = stepcost.StepModel(w, c, hw, strategies.make("sync"))
    t = model.step(widths, ["branched"], speeds, np.ones(1))
    coef = np.array([hw.step_overhead_s, 1 / hw.device_flops, 0.25 / hw.device_flops, 0.0, 0.0,
                     (1 - 1 / 1.6) / hw.device_flops, hw.contention_wait_s])
    assert t.features @ coef == pytest.approx(t.seconds, rel=1e-9)
    # The fit's column at idle_speedup 1 (secant at 2) is the same for a tensor group of 2.
    plain = dataclasses.replace(hw, idle_speedup=1.0)
    probe = stepcost.StepModel(w, c, plain, strategies.make("sync"), idle_feature=True)
    assert probe.step(widths, ["branched"], speeds, np.ones(1)).features == pytest.approx(
        t.features, rel=1e-9)
  wait = model.step(widths, ["branched"], np.array([[[1.0, 0.4]]]), np.ones(1)).seconds
  none = stepcost.StepModel(w, c, dataclasses.replace(hw, contention_wait_s=0.0),
                            strategies.make("sync"))
  assert wait - none.step(widths, ["branched"], np.array([[[1.0, 0.4]]]), np.ones(1)).seconds \
      == pytest.approx(0.02 * 0.6)
