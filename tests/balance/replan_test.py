"""Re-planning a pipelined layout on new speeds (`balance.replan`).

The best candidate is at least as fast as every layer partition within the compiled slots
(searched exhaustively, units split as the re-plan splits them), gives a slow device fewer
units and its stage fewer layers, and stays in the compiled shapes. The decision moves only
when the gain over the expected regime pays the move (priced by its kind: a costly layer move
leaves the cheaper units move), after a change lasts `confirm` samples, and not within
`min_dwell_steps` of the last move. A slow pipeline gets fewer microbatches (the best split,
exhaustively), a move that moves nothing.
"""

import itertools

import numpy as np
import pytest

from semijax.balance import buckets
from semijax.balance import replan
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import pipeline_layout

LAYERS, CAPACITY = 8, 6


def emulator(speeds=(1, 1, 1, 1), bandwidth=np.inf, pipelines=1):
  n = len(speeds)
  devices = emulation.Devices.from_regions(speeds, [0] * n, [[1e-4]], [[bandwidth]])
  grid = np.arange(n).reshape(pipelines, 2, n // (2 * pipelines))
  return emulation.PipelineEmulator(devices, grid, {"mlp": 0.02, "heads": 0.5}, 1e5, 4e7, 1e6,
                                    "1f1b", (1.0, 2.0))


def start_layout(tensor=2):
  units = layout_lib.Layout.for_model(d_model=64, num_heads=8, d_ff=256, num_devices=tensor)
  big = buckets.bucket_layout(units, 2.0, 4)
  return pipeline_layout.PipeLayout.build(LAYERS, "even", [big, big], capacity=CAPACITY)


def planner(em=None, **kw):
  return replan.Replanner(em or emulator(), start_layout(), (4,), 100, **kw)


def test_best_beats_every_partition_and_unloads_the_slow_device():
  rp = planner()
  speeds = np.array([1.0, 0.25, 1.0, 1.0])              # stage 0, tensor position 1
  layout, seconds = rp.best(speeds)
  assert seconds == pytest.approx(rp.seconds(layout, speeds))
  units = layout.units
  for kind in ("mlp", "heads"):
    fast, slow = units[0].kinds()[kind].counts
    assert slow < fast
    assert units[1].kinds()[kind].counts == layout_lib.even_counts(
        units[1].kinds()[kind].num_units, 2)
  assert layout.stage_layers[0] < layout.stage_layers[1] <= CAPACITY
  assert layout.bucket() == rp.layout.bucket()
  # Exhaustively: no partition within the slots, with these units, is faster.
  for counts in itertools.product(range(1, CAPACITY + 1), repeat=2):
    if sum(counts) == LAYERS:
      assert seconds <= rp.seconds(replan.with_layers(layout, counts), speeds) + 1e-12
  assert seconds < rp.seconds(rp.layout, speeds) * 0.8


def test_equal_speeds_keep_the_even_layout():
  rp = planner(confirm=1, min_dwell_steps=0)
  for step in range(6):
    assert rp.observe(step, np.ones(4), step_s=1e-3) is None
  layout, _ = rp.best(np.ones(4))
  assert layout == rp.layout


def test_slowest_pipeline_sets_each_positions_units():
  # Two pipelines: position 0 of stage 1 is slow in pipeline 1 only; both share the layout.
  em = emulator((1, 1, 1, 1, 1, 1, 0.5, 1), pipelines=2)
  targets = replan.stage_targets(start_layout(), em.grid, em.devices.speeds)
  assert targets[1]["mlp"] == (85, 171) and targets[1]["heads"] == (3, 5)
  assert targets[0]["mlp"] == (128, 128) and targets[0]["heads"] == (4, 4)
  # Here moving layers off stage 1 leaves it slack: the current units tie, and are kept.
  rp = replan.Replanner(em, start_layout(), (2, 2), 100)
  layout, _ = rp.best(em.devices.speeds)
  assert layout.stage_layers[0] > layout.stage_layers[1]
  assert layout.units == rp.layout.units


def test_a_move_is_made_when_its_gain_pays_for_it():
  speeds = np.array([1.0, 0.25, 1.0, 1.0])
  # Free moves: after `confirm` = 2 samples of the new speeds it moves.
  rp = planner(confirm=2, min_dwell_steps=0)
  assert rp.observe(0, np.ones(4), step_s=1e-3) is None
  assert rp.observe(1, speeds, step_s=1e-3) is None                 # one sample: a burst?
  proposal = rp.observe(2, speeds, step_s=1e-3)
  assert proposal is not None and proposal.new_s < proposal.now_s
  assert (proposal.now_s - proposal.new_s) * proposal.horizon_steps > proposal.move_s
  rp.moved(2, proposal, seconds=1e-3)
  assert rp.layout == proposal.layout and rp.moves == 1
  assert rp.observe(3, speeds, step_s=1e-3) is None                 # already there
  # A move priced above what the gain earns over the expected regime is not made...
  costly = planner(confirm=1, min_dwell_steps=0)
  costly.overhead_s = {"units": 1e6, "layers": 1e6}
  assert all(costly.observe(s, speeds, step_s=1e-3) is None for s in range(5))
  # ... nor one within `min_dwell_steps` of the last move.
  dwell = planner(confirm=1, min_dwell_steps=10)
  dwell.last_move = 0
  assert all(dwell.observe(s, speeds, step_s=1e-3) is None for s in range(1, 10))
  assert dwell.observe(10, speeds, step_s=1e-3) is not None


def test_a_costly_layer_move_leaves_the_cheaper_units_move():
  speeds = np.array([1.0, 0.25, 1.0, 1.0])
  free = planner(confirm=1, min_dwell_steps=0)
  free.overhead_s = {"units": 0.0, "layers": 0.0}
  best = free.observe(0, speeds, step_s=1e-3)
  assert replan.move_kind(free.layout, best.layout) == "layers"
  costly = planner(confirm=1, min_dwell_steps=0)
  costly.overhead_s = {"units": 0.0, "layers": 1e6}
  units = costly.observe(0, speeds, step_s=1e-3)
  assert units.layout.layers == costly.layout.layers and units.layout != costly.layout
  assert best.new_s < units.new_s < units.now_s
  # Warm-up's trial moves: one of each kind, inside the compiled shapes.
  trials = replan.trials(start_layout())
  assert {k: replan.move_kind(start_layout(), t) for k, t in trials.items()} == {
      "units": "units", "layers": "layers"}
  assert all(t.bucket() == start_layout().bucket() for t in trials.values())


def test_a_slow_pipeline_gets_fewer_microbatches():
  # Two pipelines of 2 stages of 1 tensor device; device 2 (pipeline 1, stage 0) is slow. Its
  # stage's units cannot move (one device), its pipeline's microbatches can.
  em = emulator((1, 1, 0.25, 1), pipelines=2)
  layout = start_layout(tensor=1)
  rp = replan.Replanner(em, layout, (4, 4), 100, confirm=1, min_dwell_steps=0, most=7)
  split, seconds = rp.best_split(layout, em.devices.speeds)
  assert split[1] < split[0] and sum(split) == 8 and max(split) <= 7
  for counts in itertools.product(range(1, 8), repeat=2):             # exhaustively the best
    if sum(counts) == 8:
      assert seconds <= rp.seconds(layout, em.devices.speeds, counts) + 1e-12
  # With layer moves priced out, the re-plan re-splits the batch (and moves nothing).
  rp.overhead_s = {"units": 1e6, "layers": 1e6}
  proposal = rp.observe(0, em.devices.speeds, step_s=1e-3)
  assert proposal.layout == layout and proposal.microbatches == split
  assert replan.move_kind(layout, proposal.layout) == "split" and proposal.move_s == 0
  rp.moved(0, proposal, seconds=1e-3)
  assert rp.microbatches == split
  # One pipeline: nothing to re-split.
  assert planner().best_split(start_layout(), np.ones(4)) == ((4,), planner().seconds(
      start_layout(), np.ones(4)))


def test_moving_state_over_slower_links_costs_more():
  slow_link = planner(emulator(bandwidth=1e8))
  fast_link = planner(emulator(bandwidth=1e10))
  layout, _ = slow_link.best(np.array([1.0, 0.25, 1.0, 1.0]))
  assert slow_link.link_seconds(slow_link.layout, slow_link.layout) == 0.0
  assert slow_link.link_seconds(slow_link.layout, layout) > fast_link.link_seconds(
      fast_link.layout, layout) > 0


def test_many_stages_move_a_layer_to_a_neighbour_or_off_the_busiest():
  counts = (2,) * 10
  near = replan.neighbours(counts, 4, weights=[1.0] * 9 + [3.0])      # stage 9 is the busiest
  moves = set()
  for c in near:
    diff = np.asarray(c) - np.asarray(counts)
    moves.add((int(np.argmin(diff)), int(np.argmax(diff))))
  assert all(abs(i - j) == 1 or i == 9 for i, j in moves)
  assert len(moves) == len(near) == 18 + 8
  assert len(replan.neighbours((2, 2, 2), 4)) == 6                    # few stages: any to any


def test_the_search_runs_once_per_regime_and_layout():
  rp = planner(confirm=1, min_dwell_steps=0)
  rp.overhead_s = {"units": 1e9, "layers": 1e9}                     # never moves
  searched, best = [], rp.best
  rp.best = lambda speeds: searched.append(1) or best(speeds)
  slow = np.array([1.0, 0.25, 1.0, 1.0])
  for step in range(5):
    assert rp.observe(step, slow, step_s=1e-3) is None
  assert len(searched) == 1
  rp.observe(5, np.array([1.0, 1.0, 0.25, 1.0]), step_s=1e-3)
  assert len(searched) == 2
