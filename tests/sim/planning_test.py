"""The planner on the simulator's clusters: its links are the simulator's, a slower stage gets
fewer layers, and the study's `planner` column simulates those layers."""

import dataclasses

import numpy as np
import pytest

from semijax.planner import costs as costs_lib
from semijax.planner import predict
from semijax.sim import planning
from semijax.sim import profiles
from semijax.sim import simulator
from semijax.sim import study
from semijax.sim import traces

HW = profiles.gpu_h100(0.03)


def slow_stage_speeds(cluster, stage: int, speed: float) -> np.ndarray:
  """float [D]: every device of pipeline stage `stage` (in every replica) at `speed`, others 1."""
  speeds = np.ones(cluster.shape)
  speeds[:, stage] = speed
  return speeds.reshape(-1)


def test_the_planners_links_are_the_simulators():
  base = study.base_run(64, "slow_link", HW, 10)          # 2 replicas in 2 regions
  c = planning.planner_cluster(base.cluster, HW, np.ones(64))
  tensor, pipe, region = HW.link("tensor"), HW.link("pipe"), HW.link("region")
  assert c.regions.tolist() == [0] * 32 + [1] * 32
  assert c.bandwidth[0, 7] == tensor.bytes_per_s and c.latency_s[0, 7] == tensor.latency_s
  assert c.bandwidth[0, 8] == pipe.bytes_per_s and c.latency_s[0, 31] == pipe.latency_s
  assert c.bandwidth[0, 32] == region.bytes_per_s and c.latency_s[63, 0] == region.latency_s
  assert c.memory.tolist() == [planning.DEVICE_MEMORY] * 64
  with pytest.raises(ValueError, match="one speed per device"):
    planning.planner_cluster(base.cluster, HW, np.ones(8))


def test_a_slower_stage_gets_fewer_layers():
  base = study.base_run(64, "none", HW, 30)
  # Equal devices: the last stage also runs the head over a 50,304-token vocabulary (several
  # layers' worth at tensor 8), so it gets fewer layers; the simulator, which prices the head
  # in its own model, agrees that this beats equal layers.
  layers = planning.stage_layers(base, np.ones(64))
  assert sum(layers) == 32 and layers[3] < min(layers[:3]) and max(layers[:3]) - min(
      layers[:3]) <= 1
  trace = traces.Trace(64, 1, [])
  equal = simulator.simulate(base, trace)
  planned = simulator.simulate(dataclasses.replace(base, layers=layers), trace)
  assert planned.tokens_per_s > 1.05 * equal.tokens_per_s
  layers = planning.stage_layers(base, slow_stage_speeds(base.cluster, 1, 0.5))
  assert sum(layers) == 32 and layers[1] < min(layers[0], layers[2])
  assert layers[1] <= 6          # 2x slower compute, the same tensor all-reduces: 6 of 32


def test_the_whole_plan_trains_the_runs_batch_at_its_predicted_time():
  base = study.base_run(64, "none", HW, 10)
  plan = planning.plan(base, np.ones(64))
  assert plan.data * plan.pipe * plan.tensor == 64 and sum(plan.stage_layers) == 32
  # The run's global batch: 2 replicas of 16 examples, in microbatches of 1, 2 or 4.
  assert plan.microbatch_size in (1, 2, 4) and sum(plan.microbatches) * plan.microbatch_size == 32
  # Its predicted step is the loop-by-loop time model's (`planner.predict`) for the study's GPT
  # at the profile's FLOP rate on the simulator's links.
  costs = costs_lib.ModelCosts.from_spec(base.workload.spec, HW.device_flops / 1e9)
  cluster = planning.planner_cluster(base.cluster, HW, np.ones(64))
  want = predict.predict(plan, costs, cluster)["step_s"]
  assert plan.predicted_s == pytest.approx(want, rel=1e-9)


def test_mean_speeds_follow_the_trace_on_the_runs_clock():
  trace = traces.Trace(4, 1, [[1.5, 2, 0.5]])
  speeds = planning.mean_speeds(trace, np.ones(4))        # steps start at 0, 1, 2, 3 s
  np.testing.assert_allclose(speeds, [1.0, 1.0, 0.75, 1.0])
  assert trace.at(0, 0.0)[0].tolist() == [1.0] * 4         # reset after


def test_the_planner_column_simulates_the_planners_layers():
  # Stage 1 at quarter speed: slower than the last stage with the head.
  base = study.base_run(64, "none", HW, 30)
  speeds = slow_stage_speeds(base.cluster, 1, 0.25)
  trace = traces.Trace(64, 1, [[0.0, d, 0.25] for d in np.flatnonzero(speeds < 1)])
  even = simulator.simulate(base, trace)
  static = study.column_run(base, "static", trace, even)
  planned = study.column_run(base, "planner", trace, even)
  assert study.stage_layers(static) == [8, 8, 8, 8]
  layers = study.stage_layers(planned)
  assert layers[1] < min(layers[0], *layers[2:]) and planned.policy == "static"
  assert simulator.simulate(planned, trace).tokens_per_s > 1.2 * even.tokens_per_s
