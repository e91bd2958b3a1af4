"""The study runs end to end on a small grid and reports every column."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from semijax.sim import profiles
from semijax.sim import study
from semijax.sim import traces

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


def test_replaying_a_stored_trace_reproduces_the_scenario_it_was_taken_from(tmp_path):
  hw = profiles.gpu_h100(0.03)
  trace = study.trace_for(study.base_run(64, "persistent", hw, 40), "persistent")
  path = tmp_path / "trace.json"
  path.write_text(json.dumps(trace.to_json()))
  result = study.run(hw, sizes=(64,), scenarios=("persistent", "replay"),
                     policies=("even", "semi"), steps=40,
                     scenario_params={"replay": {"path": str(path)}})
  cells = {(c["scenario"], c["policy"]): c for c in result["cells"]}
  assert cells[("persistent", "even")]["vs_ideal"] < 0.95       # the trace slows the run
  for policy in ("even", "semi"):
    assert cells[("replay", policy)]["tokens_per_s"] == pytest.approx(
        cells[("persistent", policy)]["tokens_per_s"], rel=1e-9)


@pytest.mark.parametrize("args, line", [
    (["--scenarios=replay"], "--trace: the replay scenario needs a trace file"),
    (["--scenarios=replay", "--trace={trace}", "--sizes=64,256"],
     "--sizes: the replay trace has 64 devices; give --sizes=64"),
    (["--scenarios=replay", "--trace={missing}", "--sizes=64"], "--trace: cannot read '"),
    (["--scenarios=none", "--trace={trace}"], "--trace: only the replay scenario plays a trace"),
])
def test_simulate_refuses_a_bad_replay_in_one_line(tmp_path, args, line):
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps(traces.Trace(64, 1, [[0.0, 3, 0.5]]).to_json()))
  args = [a.format(trace=trace, missing=tmp_path / "nope.json") for a in args]
  done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "simulate.py"),
                         *args, "--steps=5", f"--out={tmp_path / 'out'}"],
                        capture_output=True, text=True, timeout=120, cwd=ROOT)
  assert done.returncode != 0 and not (tmp_path / "out").exists()
  last = done.stderr.strip().splitlines()[-1]
  assert line in last and "Traceback" not in done.stderr, done.stderr
