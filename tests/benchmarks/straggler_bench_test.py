"""The straggler benchmark's bookkeeping: ratios, loss differences and the noise spread, on
hand-built raw runs (the runs themselves are exercised by the launch and train tests)."""

import pytest

from benchmarks import straggler as sb


def run(tps, loss, migrations=0):
  return {"tokens_per_s": tps, "final_val_loss": loss, "compiles_after_warmup": 0,
          "migrations": migrations, "decisions": 0, "measure_overhead": None,
          "final_counts": {}, "changes": []}


RAW = {"runs": {
    "none": {"even": run(100.0, 2.0), "static": run(110.0, 2.0), "semi": run(90.0, 2.0),
             "offload": run(50.0, 2.0)},
    "steady": {"even": run(50.0, 2.0), "static": run(80.0, 2.0), "semi": run(72.0, 2.01,
                                                                              migrations=1)},
}}


def test_summarize_gives_ratios_to_even_and_oracle_and_the_loss_difference():
  out = sb.summarize(RAW, ("none", "even"))
  semi = out["steady"]["semi"]
  assert semi["ratio_vs_even"] == pytest.approx(72 / 50)
  assert semi["ratio_vs_oracle"] == pytest.approx(72 / 80)
  assert semi["val_loss_vs_baseline"] == pytest.approx(0.005)
  assert semi["migrations"] == 1
  assert out["none"]["static"]["ratio_vs_even"] == pytest.approx(1.1)
  assert out["none"]["even"]["ratio_vs_oracle"] == pytest.approx(100 / 110)
  table = sb.markdown(out, "t")
  assert "| steady | semi | 72 | 1.44 | 0.90 | 2.0100 | +0.50% | 0 | 1 |" in table


def test_noise_spread_covers_the_runs_of_the_same_split_only():
  out = sb.summarize(RAW, ("none", "even"))
  assert list(sb.same_split_runs(out)) == ["even", "static", "semi"]
  assert sb.noise_spread(out) == pytest.approx(110 / 90 - 1)    # offload's 50 is left out
  assert sb.noise_spread({"none": {"even": out["none"]["even"]}}) is None
  assert sb.noise_spread({}) is None
