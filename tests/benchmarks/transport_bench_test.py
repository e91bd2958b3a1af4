"""The transport A/B's bookkeeping on hand-built runs: medians, spreads, paired speed-ups and
the uneven split's gain at each nice value, and threads' CPU ticks from hand-written stat files."""

import pytest

from benchmarks import transport as tb


def _runs(walls, loop=10.0, steal=0.01):
  return [{"round": r, "wall_ms": w, "loop_cpu_ms": loop, "host_steal": steal}
          for r, w in enumerate(walls)]


def _process(loop0=20.0):
  return {"steady": {
      "even nice0": _runs([400, 440, 420], loop0), "even nice19": _runs([380, 400, 350], 8.0),
      "oracle nice0": _runs([300, 330, 320], loop0), "oracle nice19": _runs(
          [250, 300, 280], 6.0, steal=None)}}


def test_summarize_medians_spreads_and_paired_ratios():
  s = tb.summarize([_process(), _process(loop0=30.0)])["steady"]
  even0 = s["cells"]["even nice0"]
  assert (even0["wall_ms"], even0["wall_ms_min"], even0["wall_ms_max"]) == (420, 400, 440)
  assert even0["loop_cpu_ms"] == [20.0, 30.0]                 # each process's own
  assert even0["host_steal"] == pytest.approx(0.01)
  assert s["cells"]["oracle nice19"]["host_steal"] is None    # no figure: none reported
  # speed-up: nice 0 over nice 19; medians 420/380, paired rounds 400/380, 440/400, 420/350
  assert s["speedup"]["even"]["median"] == pytest.approx(420 / 380)
  assert s["speedup"]["even"]["paired"] == pytest.approx(440 / 400)
  assert s["speedup"]["oracle"]["median"] == pytest.approx(320 / 280)
  assert s["speedup"]["oracle"]["paired"] == pytest.approx(320 / 280)   # 1.2, 1.1, 1.143
  gain = s["even_over_oracle"]
  assert gain["nice0"]["median"] == pytest.approx(420 / 320)
  assert gain["nice19"]["paired"] == pytest.approx(400 / 300)      # of 1.52, 1.33, 1.25


def test_markdown_has_a_row_per_cell_and_a_line_per_scenario():
  text = tb.markdown(tb.summarize([_process(), _process()]))
  assert text.count("| steady |") == 4
  assert "| steady | oracle | 19 | 280.0 | 250-300 | 6.0 / 6.0 | –, – |" in text
  assert "even 1.11x (paired 1.10x)" in text
  assert "nice0 1.31x" in text


def test_thread_ticks_read_user_and_system_time_even_with_odd_names(tmp_path):
  rest = "S 1 2 3 4 5 6 7 8 9 10 {u} {s} 0 0 20 0 1 0"
  for tid, name, u, s in ((11, "python", 50, 7), (12, "we (ird) name", 3, 4)):
    (tmp_path / str(tid)).mkdir()
    (tmp_path / str(tid) / "stat").write_text(f"{tid} ({name}) " + rest.format(u=u, s=s))
  (tmp_path / "13").mkdir()                                    # exited: no stat
  assert tb.thread_ticks(str(tmp_path)) == {11: 57, 12: 7}
  assert tb.thread_ticks(str(tmp_path / "missing")) == {}
