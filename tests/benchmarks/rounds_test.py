"""Interleaved rounds: every cell once per round in `round_orders`' order, the figures handed on
after each round, medians with their spread, and ratios paired round by round; and the widths
benchmark, which uses them, keeps the rounds it finished when it is cut short."""

import json

import numpy as np
import pytest

from benchmarks import blocks
from benchmarks import report
from benchmarks import rounds
from benchmarks import widths


def test_interleave_runs_every_cell_once_per_round_in_the_rotated_order():
  calls, seen = [], []
  cells = {name: (lambda name=name: calls.append(name) or float(len(calls)))
           for name in ("a", "b", "c")}
  out = rounds.interleave(cells, 3, after_round=lambda f: seen.append(
      {k: list(v) for k, v in f.items()}))
  orders = rounds.round_orders(["a", "b", "c"], 3)
  assert calls == [n for order in orders for n in order]
  assert orders[0] != orders[1]                      # the order rotates
  # Each cell's figure in round r is its position in the call sequence (1-based).
  for name in cells:
    assert out[name] == [float(3 * r + orders[r].index(name) + 1) for r in range(3)]
  assert [len(s["a"]) for s in seen] == [1, 2, 3] and seen[-1] == out


def test_stats_and_paired_ratios():
  assert rounds.stats([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "rounds": 3}
  # Round 1 ran on a machine twice as slow for both cells: the paired ratio cancels it, the
  # ratio of medians would not.
  num, den = [2.0, 4.0, 2.2], [1.0, 2.0, 1.0]
  assert rounds.ratio_stats(num, den) == {"median": 2.0, "min": 2.0, "max": 2.2, "rounds": 3}
  assert np.median(num) / np.median(den) == pytest.approx(2.2)
  # Only the rounds both cells finished are paired.
  assert rounds.ratio_stats([2.0, 4.0], [1.0])["rounds"] == 1
  assert rounds.cell({"median": 1.234, "min": 1.0, "max": 1.5}, ".2f") == "1.23 (1.00-1.50)"


def test_widths_benchmark_cut_short_keeps_the_rounds_it_finished(tmp_path, monkeypatch):
  s = widths.Settings(d_model=32, heads=4, d_ff=64, seq_len=8, batch=2, num_widths=2,
                      repeats=1, rounds=3, modes=("saved",), kernels=("switch",)).validate()
  timed = {"n": 0}
  median_ms = blocks.median_ms

  def fake_median_ms(fn, *args, repeats):
    timed["n"] += 1
    if timed["n"] > 2 * 2 + 2:       # 4 cells a round: dies in round 2, after 2 cells
      raise KeyboardInterrupt("time limit")
    return median_ms(fn, *args, repeats=repeats)
  monkeypatch.setattr(blocks, "median_ms", fake_median_ms)
  with pytest.raises(KeyboardInterrupt):
    widths.run(s, out_dir=str(tmp_path))
  out = json.loads((tmp_path / "bench_widths.json").read_text())
  assert out["rounds_done"] == 1
  assert [r["mlp_width"] for r in out["widths"]] == [32, 64]
  for r in out["widths"]:
    assert r["single_ms"]["rounds"] == 1 and r["single_ms"]["median"] > 0
    ratio = r["branched_over_single"]["switch, saved"]
    assert ratio["median"] == pytest.approx(r["branched_ms"]["switch, saved"]["median"]
                                            / r["single_ms"]["median"])
  assert out["widths"][-1]["relative_to_full"]["median"] == 1.0
  assert (tmp_path / "bench_widths.md").read_text().startswith("| mlp width |")


def test_widths_settings_name_the_bad_flag():
  with pytest.raises(ValueError, match=r"^--kernels: unknown \['triton'\]"):
    widths.Settings(kernels=("triton",)).validate()
  with pytest.raises(ValueError, match=r"^--rounds: must be at least 1, got 0"):
    widths.Settings(rounds=0).validate()


def test_a_write_that_fails_leaves_the_previous_round_whole(tmp_path):
  report.write(str(tmp_path), "bench", {"rounds_done": 1}, "| a |\n")
  with pytest.raises(TypeError):      # a payload that cannot be written, half way through
    report.write(str(tmp_path), "bench", {"rounds_done": 2, "z": object()}, "| b |\n")
  assert json.loads((tmp_path / "bench.json").read_text()) == {"rounds_done": 1}
  assert (tmp_path / "bench.md").read_text() == "| a |\n"
