"""The study runs end to end on a small grid and reports every column."""

import numpy as np

from semijax.sim import profiles
from semijax.sim import study


def test_a_small_study_has_every_column_and_its_references():
  hw = profiles.gpu_h100(0.03)
  result = study.run(hw, sizes=(64,), scenarios=("none", "rotating"), steps=40)
  cells = {(c["scenario"], c["policy"]): c for c in result["cells"]}
  assert set(p for _, p in cells) == set(study.POLICIES)
  for scenario in ("none", "rotating"):
    assert cells[(scenario, "even")]["vs_even"] == 1.0
  # Nobody slow: every column with equal stages trains at the ideal (the even pipeline at full
  # speed); the planner takes layers off the stage with the head, beyond it. A rotating 8x
  # straggler: even far below it.
  assert all(np.isclose(cells[("none", p)]["vs_ideal"], 1.0, atol=0.02)
             for p in study.POLICIES if p != "planner")
  layers = cells[("none", "planner")]["stage_layers"]
  assert layers[-1] < min(layers[:-1]) and cells[("none", "planner")]["vs_even"] > 1.05
  assert cells[("rotating", "even")]["vs_ideal"] < 0.6
  assert cells[("rotating", "ssaw")]["mean_staleness"] > 0
  table = study.markdown(result)
  assert table.count("\n") == 2 + 2 and "semi+ssaw" in table
  assert f"| none | {', '.join(map(str, layers))} |" in study.layers_markdown(result)


def test_the_studys_fail_slow_1pct_hits_one_device_in_its_replicas_of_pipe_x_tensor():
  base = study.base_run(1024, "fail_slow_1pct", profiles.gpu_h100(0.03), steps=10)
  trace = study.trace_for(base, "fail_slow_1pct")
  replicas = trace.events[:, 1].astype(int) // (study.PIPE * study.TENSOR)
  assert len(trace.events) == 4 == len(set(replicas.tolist()))          # 1/8 of 32 replicas
  assert (trace.events[:, 2] == 0.01).all()
  assert "fail_slow_1pct" in study.SCENARIOS
