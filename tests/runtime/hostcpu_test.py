"""The host's steal share from /proc/stat readings: hand-written files, and this machine's."""

import pytest

from semijax.runtime import hostcpu

# Two readings 10 s apart on 2 cores (100 ticks/s): 2000 ticks, 600 of them stolen.
BEFORE = ("cpu  1000 5 300 4000 20 0 10 500 40 0\n"
          "cpu0 500 2 150 2000 10 0 5 250 20 0\n"
          "intr 12345\n")
AFTER = ("cpu  1900 5 400 4390 20 0 20 1100 90 0\n"
         "cpu0 950 2 200 2195 10 0 10 550 45 0\n")


def test_parse_reads_the_aggregate_line_not_a_core_and_leaves_out_guest_time():
  ticks = hostcpu.parse(BEFORE)
  assert ticks == {"user": 1000, "nice": 5, "system": 300, "idle": 4000, "iowait": 20,
                   "irq": 0, "softirq": 10, "steal": 500}
  assert hostcpu.parse("cpu  7 1 2 3\n")["steal"] == 0       # an old kernel without steal
  assert hostcpu.parse("cpu0 1 2 3 4\n") is None


def test_steal_share_is_stolen_ticks_over_all_ticks_between_readings():
  assert hostcpu.steal_share(hostcpu.parse(BEFORE), hostcpu.parse(AFTER)) == pytest.approx(0.3)
  assert hostcpu.steal_share(hostcpu.parse(BEFORE), hostcpu.parse(BEFORE)) is None  # no tick
  assert hostcpu.steal_share(None, hostcpu.parse(AFTER)) is None


def test_the_meter_reads_its_file_at_start_and_at_share(tmp_path):
  path = tmp_path / "stat"
  path.write_text(BEFORE)
  meter = hostcpu.StealMeter(str(path))
  path.write_text(AFTER)
  assert meter.share() == pytest.approx(0.3)
  assert hostcpu.StealMeter(str(path)).share() is None         # no tick since it started
  assert hostcpu.StealMeter(str(tmp_path / "missing")).share() is None


def test_describe_warns_only_above_the_threshold():
  assert hostcpu.describe(None) == ""
  assert hostcpu.describe(0.02) == "The hypervisor took 2% of this host's CPU time during the runs."
  loud = hostcpu.describe(0.3, "the calibration")
  assert loud.startswith("The hypervisor took 30% of this host's CPU time during the calibration.")
  assert "Above 5%" in loud


def test_this_host_gives_a_share_between_0_and_1_or_none():
  meter = hostcpu.StealMeter()
  sum(i * i for i in range(200_000))                           # let some ticks pass
  share = meter.share()
  assert share is None or 0.0 <= share <= 1.0
