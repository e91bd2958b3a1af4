"""The loop benchmark's summary: medians, spreads and per-round ratios of hand-written cells,
and one real cell of each mode on a tiny run (the same losses, a positive host time)."""

import pytest

import helpers as H
from benchmarks import host_loop


def cell(cpu, wall, loss=1.5):
  return {"host_cpu_ms": cpu, "wall_ms": wall, "step_ms": wall / 2, "loss": loss}


def test_summary_takes_medians_spreads_and_the_median_per_round_ratio():
  cells = {"wait": [cell(4.0, 10.0), cell(6.0, 30.0), cell(5.0, 20.0)],
           "ahead": [cell(2.0, 10.0), cell(6.0, 15.0), cell(4.0, 20.0)]}
  s = host_loop.summarize(cells)
  assert s["wait"]["host_cpu_ms"] == {"median": 5.0, "spread": [4.0, 6.0]}
  assert s["ahead_over_wait"]["host_cpu_ms"] == pytest.approx(0.8)     # of 0.5, 1.0, 0.8
  assert s["ahead_over_wait"]["wall_ms"] == pytest.approx(1.0)         # of 1.0, 0.5, 1.0
  assert s["same_loss"]
  table = host_loop.markdown(s, "")
  assert "| host CPU ms/step | 5.00 (4.00-6.00) | 4.00 (2.00-6.00) | 0.800 |" in table
  cells["ahead"][0] = cell(2.0, 10.0, loss=1.25)
  assert not host_loop.summarize(cells)["same_loss"]


def test_both_modes_train_to_the_same_loss():
  c = H.tiny_gpt(steps=4)
  c.log_every, c.eval_every, c.checkpoint_every = 4, 4, 0
  cache = {}
  wait, ahead = (host_loop.run_cell(c, a, cache) for a in (False, True))
  assert wait["loss"] == ahead["loss"]
  assert wait["host_cpu_ms"] > 0 and ahead["wall_ms"] > 0
