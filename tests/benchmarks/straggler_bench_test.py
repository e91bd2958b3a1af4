"""The straggler benchmark's bookkeeping on hand-built runs: round orders, medians and spreads,
paired per-round ratios, time to reach `even`'s validation loss, the noise line and the target
lines (the runs themselves are exercised by the launch and train tests)."""

import pytest

from benchmarks import rounds
from benchmarks import straggler as sb


def run(tps, loss, round_, curve=None, migrations=0, compiles=0, steal=None):
  """A raw run: `curve` [(seconds, loss), ...] (default: one point at 10 s, the final loss)."""
  curve = curve if curve is not None else [(10.0, loss)]
  return {"tokens_per_s": tps, "final_val_loss": loss, "compiles_after_warmup": compiles,
          "migrations": migrations, "decisions": 3, "measure_overhead": 0.01,
          "final_counts": {"mlp": [1, 1]}, "changes": [], "round": round_, "position": 0,
          "seed": round_, "step_times_s": [0.1] * 4, "host_steal": steal,
          "val_curve": [[t, 10 * (i + 1), v] for i, (t, v) in enumerate(curve)]}


# Three rounds; round 1 ran on a slower machine for everybody (drift), which the medians of
# tokens/s mix up and the paired ratios cancel.
EVEN = [run(100.0, 2.0, 0, [(5.0, 2.5), (10.0, 2.0)]),
        run(60.0, 2.1, 1, [(8.0, 2.6), (16.0, 2.1)]),
        run(104.0, 2.0, 2, [(5.0, 2.4), (9.6, 2.0)])]
STATIC = [run(150.0, 2.0, 0, [(3.0, 2.5), (6.0, 2.0)]),
          run(80.0, 2.1, 1, [(6.0, 2.6), (12.0, 2.1)]),
          run(140.0, 2.0, 2, [(4.0, 2.4), (7.0, 2.0)])]
# semi: faster than even, its loss ends higher in round 0 (never reaches even's 2.0) and reaches
# it between two evaluations in round 2.
SEMI = [run(135.0, 2.02, 0, [(3.0, 2.5), (7.0, 2.02)], migrations=1),
        run(66.0, 2.1, 1, [(7.0, 2.6), (14.0, 2.1)], migrations=1),
        run(130.0, 2.0, 2, [(4.0, 2.2), (6.0, 1.9), (8.0, 1.99)], migrations=2)]
RAW = {"runs": {"steady": {"even": EVEN, "static": STATIC, "semi": SEMI}}}


def test_round_orders_run_every_policy_early_and_late_after_a_different_policy_each_round():
  orders = rounds.round_orders(sb.POLICIES, 3)
  assert [o[0] for o in orders] == ["even", "resize", "offload"]
  assert all(sorted(o) == sorted(sb.POLICIES) for o in orders)
  positions = {p: [o.index(p) for o in orders] for p in sb.POLICIES}
  assert all(min(v) <= 1 and max(v) >= 4 for v in positions.values()), positions
  # A plain rotation would put every policy after the same one in every round.
  before = {p: [o[o.index(p) - 1] for o in orders if o.index(p) > 0] for p in sb.POLICIES}
  assert all(len(set(v)) == len(v) for v in before.values()), before
  # Over a whole Williams square (rounds = policies) every ordered pair is adjacent once.
  square = rounds.round_orders(sb.POLICIES, len(sb.POLICIES))
  pairs = [(o[k], o[k + 1]) for o in square for k in range(len(o) - 1)]
  assert len(pairs) == len(set(pairs)) == len(sb.POLICIES) * (len(sb.POLICIES) - 1)
  assert rounds.round_orders(["a", "b"], 1) == [["a", "b"]]
  assert rounds.round_orders(["a", "b"], 4) == [["a", "b"], ["b", "a"], ["a", "b"], ["b", "a"]]


def test_median_and_spread():
  assert sb.median([3.0, 1.0, 2.0]) == 2.0
  assert sb.median([3.0, None, 1.0]) == 3.0        # None = never, counted as +infinity
  assert sb.median([None, None, 1.0]) is None      # the median run never got there
  assert sb.median([]) is None
  assert sb.spread([100.0, 60.0, 104.0]) == pytest.approx(104 / 60 - 1)
  assert sb.spread([100.0]) is None


def test_time_to_loss_interpolates_between_evaluations():
  curve = [[4.0, 10, 2.2], [6.0, 20, 1.9], [8.0, 30, 1.99]]
  assert sb.time_to_loss(curve, 2.0, tol=0) == pytest.approx(4.0 + 2.0 * 0.2 / 0.3)
  assert sb.time_to_loss(curve, 2.5, tol=0) == 4.0        # reached at the first evaluation
  assert sb.time_to_loss(curve, 1.8, tol=0) is None       # never
  # The tolerance absorbs float rounding between layouts of the same model, nothing more.
  assert sb.time_to_loss([[1.0, 1, 3.0], [2.0, 2, 2.0001]], 2.0) == 2.0
  assert sb.time_to_loss([[1.0, 1, 3.0], [2.0, 2, 2.001]], 2.0) is None


def test_paired_ratios_cancel_drift_that_hits_a_whole_round():
  assert sb.paired_ratios(SEMI, EVEN) == pytest.approx([1.35, 1.1, 1.25])
  assert sb.paired_ratios(SEMI, EVEN[:2]) == pytest.approx([1.35, 1.1])   # rounds both have


def test_summarize_uses_medians_paired_ratios_and_the_time_to_even_loss():
  out = sb.summarize(RAW)["steady"]
  semi, static, even = out["semi"], out["static"], out["even"]
  assert semi["tokens_per_s"] == 130.0
  assert (semi["tokens_per_s_min"], semi["tokens_per_s_max"]) == (66.0, 135.0)
  assert semi["tokens_per_s_spread"] == pytest.approx(135 / 66 - 1)
  assert semi["ratio_vs_even"] == pytest.approx(130 / 100)            # of medians
  assert semi["ratio_vs_oracle"] == pytest.approx(130 / 140)
  assert semi["paired_ratio_vs_even"] == pytest.approx(1.25)          # median of 1.35, 1.1, 1.25
  assert semi["paired_ratio_vs_oracle"] == pytest.approx(sorted(
      [135 / 150, 66 / 80, 130 / 140])[1])
  assert static["paired_ratio_vs_even"] == pytest.approx(sorted(
      [1.5, 80 / 60, 140 / 104])[1])
  assert even["ratio_vs_even"] == 1.0 and even["paired_ratio_vs_even"] == 1.0
  # Loss: median and mean against even's of the same scenario.
  assert semi["final_val_loss"] == 2.02
  assert semi["final_val_loss_mean"] == pytest.approx(6.12 / 3)
  assert semi["val_loss_vs_baseline"] == pytest.approx(2.02 / 2.0 - 1)
  assert semi["mean_val_loss_vs_baseline"] == pytest.approx(6.12 / 6.1 - 1)
  # Time to even's final loss of the same round: round 0 never (2.02 > 2.0), round 1 at 14 s,
  # round 2 between the evaluations at 4 s and 6 s; even itself at its last evaluation.
  times = [r["time_to_even_loss_s"] for r in semi["runs"]]
  assert times[0] is None and times[1] == 14.0
  assert times[2] == pytest.approx(4.0 + 2.0 * 0.2 / 0.3)
  assert semi["reached_even_loss"] == 2
  assert semi["time_to_even_loss_s"] == 14.0                          # median, None = never
  assert [r["time_to_even_loss_s"] for r in even["runs"]] == [10.0, 16.0, 9.6]
  assert semi["time_to_even_loss_speedup"] == pytest.approx(16 / 14)   # median of 0, 1.14, 1.8
  assert static["time_to_even_loss_speedup"] == pytest.approx(sorted(
      [10 / 6, 16 / 12, 9.6 / 7])[1])
  # Every run keeps its own figures; the cell keeps the median run's details.
  assert [r["round"] for r in semi["runs"]] == [0, 1, 2]
  assert [r["tokens_per_s"] for r in semi["runs"]] == [135.0, 66.0, 130.0]
  assert semi["migrations"] == 1 and semi["compiles_after_warmup"] == 0


def test_summarize_takes_a_single_run_per_cell_and_leaves_missing_references_empty():
  out = sb.summarize({"runs": {"none": {"even": run(100.0, 2.0, 0), "semi": run(90.0, 2.0, 0)},
                               "steady": {"semi": [run(90.0, 2.0, 0)]}}})
  assert out["none"]["semi"]["ratio_vs_even"] == pytest.approx(0.9)
  assert out["none"]["semi"]["ratio_vs_oracle"] is None    # no static run
  assert out["none"]["semi"]["tokens_per_s_spread"] is None
  assert out["steady"]["semi"]["ratio_vs_even"] is None
  assert out["steady"]["semi"]["time_to_even_loss_s"] is None


def test_noise_is_the_spread_of_the_repeated_even_runs():
  results = sb.summarize(RAW)
  assert sb.noise(results) == {"steady": pytest.approx(104 / 60 - 1)}
  line = sb.noise_line(results)
  assert "`even` ran 3x per scenario" in line and "steady 73%" in line


def test_host_steal_per_cell_and_scenario_and_a_warning_above_the_threshold():
  even = [run(100.0, 2.0, 0, steal=0.01), run(98.0, 2.0, 1, steal=0.02)]
  quiet = {"runs": {"none": {"even": even,
                             "semi": [run(99.0, 2.0, 0, steal=0.0), run(97.0, 2.0, 1)]}}}
  results = sb.summarize(quiet)
  semi = results["none"]["semi"]
  assert semi["host_steal"] == 0.0 and semi["host_steal_max"] == 0.0   # the run without a figure
  assert [r["host_steal"] for r in semi["runs"]] == [0.0, None]        # is left out
  assert sb.host_steal(results) == {"none": {"median": pytest.approx(0.01), "max": 0.02}}
  line = sb.noise_line(results)
  assert "none 1%, 2%" in line and "Above" not in line
  assert "| none | semi | 98 |" in sb.markdown(results, "t")
  assert sb.markdown(results, "t").splitlines()[-1].endswith("| 0% |")
  noisy = sb.summarize({"runs": {"steady": {"even": [run(100.0, 2.0, 0, steal=0.3)]}}})
  assert "steady 30%, 30%. **Above 5%, the ratios measure the host" in sb.noise_line(noisy)
  # Without steal figures (not Linux) nothing is said about the host.
  bare = sb.summarize(RAW)
  assert sb.host_steal(bare) == {} and "host" not in sb.noise_line(bare)
  assert bare["steady"]["semi"]["host_steal"] is None


def test_markdown_and_target_lines():
  results = sb.summarize(RAW)
  table = sb.markdown(results, "t")
  assert ("| steady | semi | 130 | 105% | 1.30 | 1.25 | 0.93 | 0.90 | 14.0 (1.14x) | 2.0400 "
          "| +0.33% | 0 | 1 | – |") in table
  assert "| steady | even | 100 | 73% | 1.00 | 1.00 |" in table
  lines = sb.target_lines({"scenarios": results})
  assert ("- steady: semi vs oracle (ratio_vs_oracle) = 0.93, paired 0.90 (target >= 0.95): "
          "NOT met") in lines
  assert "- steady: semi vs even (ratio_vs_even) = 1.30, paired 1.25 (target >= 1.3): met" in lines
  assert ("- steady: semi mean val loss vs even (mean_val_loss_vs_baseline) = +0.33% "
          "(target <= +0.5%): met") in lines
  assert not any(line.startswith("- bursts") for line in lines)    # cells not run: no line


def test_the_oracle_balances_time_with_the_repeated_work():
  # 1024 MLP units in granules of 16 at speeds (1, 0.38): without repeated work the split is
  # proportional (64 granules: 47 / 17 finishes at max(47, 44.7), 46 / 18 at max(46, 47.4));
  # with 0.35 of the block work repeated on each device (22.4 granules),
  # (x + 22.4) / 1 = (64 - x + 22.4) / 0.38 gives x = 56.4: granules 57 / 7 (times 79.4 and
  # 77.4; 56 / 8 would take 80): 912 / 112.
  assert sb.split_counts(1024, (1.0, 0.38), 0.0) == (752, 272)
  assert sb.split_counts(1024, (1.0, 0.38), 0.35) == (912, 112)
  base = sb.real_config(quick=True)
  oracle = sb.policy_config(base, "static", (1.0, 0.38), seed=3, repeat=0.35)
  assert tuple(oracle.layout.mlp) == (912, 112) and oracle.seed == 3
  semi = sb.policy_config(base, "semi", (1.0, 0.38), repeat=0.35, fit_repeat=False)
  assert semi.balance.repeat_share == 0.35 and semi.balance.policy == "semi"
  assert semi.balance.fit_repeat is False and base.balance.fit_repeat is True
  assert semi.balance.measure == base.balance.measure == "auto"
  probed = sb.policy_config(base, "semi@probe", (1.0, 0.38))
  assert probed.balance.policy == "semi" and probed.balance.measure == "probe"
  # Two idle cores measured with noise: the oracle is the even split.
  assert tuple(sb.policy_config(base, "static", (1.0, 0.95), repeat=0.35).layout.mlp) == (
      512, 512)


@pytest.mark.parametrize("quick", [False, True])
def test_every_real_run_follows_one_schedule_and_differs_only_in_length(quick):
  configs = [sb.real_config(quick, s) for s in sb.SCENARIOS]
  steps = [c.steps for c in configs]
  assert {c.optimizer.schedule_steps for c in configs} == {max(steps)}
  if not quick:
    assert min(steps) < max(steps)      # the runs without contention are shorter
  # Runs differ in length only: everything else a compiled step depends on is the same.
  strip = lambda c: {k: v for k, v in c.to_dict().items() if k not in ("steps", "eval_every")}
  assert all(strip(c) == strip(configs[0]) for c in configs)
