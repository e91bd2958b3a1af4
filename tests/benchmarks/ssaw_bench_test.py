"""The SSAW study's bookkeeping (benchmarks/ssaw.py) on made-up runs: figures at the sample
budget, time to sync's loss, paired ratios, the targets and the table."""

import pytest

from benchmarks import ssaw as sb


def rec(r, curve):
  """A run record: curve = [[seconds, samples, val loss, val accuracy], ...], budget 100."""
  return {"round": r, "seed": r, "curve": curve, "seconds": sb.at_samples(curve, 100, 0),
          "samples_per_s": 100 / sb.at_samples(curve, 100, 0),
          "final_val_loss": sb.at_samples(curve, 100, 2),
          "final_val_accuracy": sb.at_samples(curve, 100, 3), "updates": 10}


def test_at_samples_interpolates_and_holds_the_last_point():
  curve = [[1.0, 50, 3.0, 0.1], [3.0, 100, 2.0, 0.3], [4.0, 125, 1.8, 0.4]]
  assert sb.at_samples(curve, 75, 2) == pytest.approx(2.5)
  assert sb.at_samples(curve, 100, 0) == 3.0
  assert sb.at_samples(curve, 200, 3) == 0.4


def test_summarize_cell_pairs_every_round_with_sync():
  runs = {
      "sync": [rec(0, [[2.0, 50, 3.0, 0.1], [4.0, 100, 2.0, 0.3]]),
               rec(1, [[2.0, 50, 3.2, 0.1], [4.0, 100, 2.2, 0.3]])],
      # twice as fast, a little worse at the budget; reaches sync's loss after it
      "ssaw": [rec(0, [[1.0, 50, 3.0, 0.1], [2.0, 100, 2.1, 0.3], [2.5, 125, 1.9, 0.35]]),
               rec(1, [[1.0, 50, 3.2, 0.1], [2.0, 100, 2.3, 0.3], [2.5, 125, 2.15, 0.3]])],
      "local_sgd": [rec(0, [[4.0, 100, 2.5, 0.2]]), rec(1, [[4.0, 100, 2.6, 0.2]])],
  }
  out = sb.summarize_cell(runs)
  assert out["sync"]["speedup_to_sync_loss"] == 1.0 and out["sync"]["reached"] == "2/2"
  s = out["ssaw"]
  assert s["samples_per_s"] == pytest.approx(50.0)
  assert s["val_loss_vs_sync"] == pytest.approx((2.1 + 2.3) / (2.0 + 2.2) - 1)
  assert s["reached"] == "2/2"
  # round 0: 2.0 reached at 2.0 + 0.5 * (2.1 - 2.0) / (2.1 - 1.9) = 2.25 s; round 1: 2.2 at
  # 2.0 + 0.5 * (2.3 - 2.2) / (2.3 - 2.15) = 2.333 s; sync took 4 s in both.
  assert s["speedup_to_sync_loss"] == pytest.approx((4 / 2.25 + 4 / (2 + 1 / 3)) / 2)
  assert out["local_sgd"]["reached"] == "0/2" and out["local_sgd"]["time_to_sync_loss_s"] is None
  assert out["local_sgd"]["speedup_to_sync_loss"] == 0.0


def test_a_run_that_never_reached_counts_as_infinitely_slow():
  runs = {"sync": [rec(r, [[4.0, 100, 2.0, 0.3]]) for r in range(3)],
          "async": [rec(0, [[1.0, 100, 1.9, 0.3]]), rec(1, [[1.0, 100, 2.5, 0.3]]),
                    rec(2, [[1.0, 100, 2.5, 0.3]])]}
  out = sb.summarize_cell(runs)["async"]
  assert out["reached"] == "1/3" and out["time_to_sync_loss_s"] is None
  assert out["speedup_to_sync_loss"] == 0.0


def test_targets_and_table():
  cell = {"sync": rec(0, [[4.0, 100, 2.0, 0.3]]),
          "ssaw": rec(0, [[2.0, 100, 2.005, 0.3], [2.5, 125, 1.9, 0.3]]),
          "async": rec(0, [[2.0, 100, 2.1, 0.3], [3.0, 125, 1.99, 0.3]]),
          "local_sgd": rec(0, [[4.0, 100, 2.3, 0.3]])}
  results = {"gpt_tiny": {"4x1_slow2": sb.summarize_cell({k: [v] for k, v in cell.items()})}}
  targets = {t["target"]: t for t in sb.targets(results, None)}
  speed = targets["gpt_tiny 4x1_slow2: ssaw reaches sync's loss >= 1.2x sooner"]
  assert speed["met"] and speed["value"] > 1.2
  assert targets["gpt_tiny 4x1_slow2: ssaw's final loss within 0.5% of sync's"]["met"]
  ahead = targets["ssaw ahead of async and local_sgd on time to sync's loss in most settings"]
  assert ahead["value"] == "2/2" and ahead["met"]
  table = sb.markdown(results, "t")
  assert "| gpt_tiny | 4x1_slow2 | ssaw |" in table and table.count("\n| gpt_tiny") == 4
