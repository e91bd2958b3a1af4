"""A pipelined run's online re-planning (`balance.policy = "semi"` with `mesh.pipe` > 1 or a
plan): every `balance.probe_every` steps the devices' speeds are sampled, `balance.replan`
decides whether moving layers between stages and units inside them pays, and the state moves
(`core.pipeline.PipelineEngine.move`: weights and Adam moments together, between the compiled
slots and widths, so nothing recompiles but the migration).

The speeds are the emulated ones (`hetero.device_speeds`, shifted by one device id every
`hetero.rotate_every` steps); the emulation sleeps each step's time at the speeds of that step
and each move's transfers over the emulated links.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from semijax.balance import replan as replan_lib
from semijax.core import emulation
from semijax.core import pipeline
from semijax.train import config as config_lib
from semijax.train import pipeline_setup as setup_lib


def layout_text(layout: pipeline.PipeLayout) -> str:
  """"layers 3,5; mlp 12,4 | 8,8; heads 3,1 | 2,2" (stages apart by |)."""
  kinds = " ".join(f"{k} " + " | ".join(",".join(map(str, u.kinds()[k].counts))
                                       for u in layout.units) + ";"
                   for k in layout.units[0].kinds())
  return f"layers {','.join(map(str, layout.stage_layers))}; {kinds.rstrip(';')}"


class StageBalancer:
  """Samples speeds, asks the `replan.Replanner` and moves the state (see module doc).

  Args:
    run: the validated run (`balance`, `pipeline.rotate_every`, `steps`).
    setup: its plan, engine, start layout and emulation (`pipeline_setup.build`; the emulation
      is set: `config` requires `hetero.device_speeds` for `semi`).
  """

  def __init__(self, run: config_lib.RunConfig, setup: setup_lib.Setup):
    self.engine, self.emulator = setup.engine, setup.emulator
    self.every, self.rotate = run.balance.probe_every, run.pipeline.rotate_every
    b = run.balance
    self.replanner = replan_lib.Replanner(
        setup.emulator, setup.layout, setup.plan.microbatches, run.steps,
        hysteresis=b.hysteresis, min_dwell_steps=b.min_dwell_steps, speed_alpha=b.speed_alpha,
        change_threshold=b.change_threshold, confirm=b.confirm)
    self.microbatches = setup.plan.microbatches

  @property
  def layout(self) -> pipeline.PipeLayout:
    return self.replanner.layout

  def speeds_at(self, step: int) -> np.ndarray:
    """float [D]: the emulated devices' speeds in 0-based `step`."""
    return self.emulator.devices.speeds_at(step, self.rotate)

  def emulated(self, step: int) -> dict:
    """The emulated time of 0-based `step` in the current layout
    (`PipelineEmulator.layout_step`)."""
    return self.emulator.with_speeds(self.speeds_at(step)).layout_step(self.layout,
                                                                       self.microbatches)

  def after_step(self, step: int, state, step_s: float):
    """(state, note or None): on a sampling step, the state moved to a re-plan that pays."""
    if (step + 1) % self.every:
      return state, None
    proposal = self.replanner.observe(step, self.speeds_at(step), step_s)
    if proposal is None:
      return state, None
    old = self.layout
    t0 = time.perf_counter()
    state = self.engine.move(state, old, proposal.layout, donate=True)
    jax.block_until_ready(state)
    emulation.Emulator.sleep(proposal.link_s)
    seconds = time.perf_counter() - t0
    self.replanner.moved(step, proposal, seconds)
    note = (f"re-plan after step {step + 1}: {layout_text(old)} -> "
            f"{layout_text(proposal.layout)}; predicted {proposal.now_s:.3f} -> "
            f"{proposal.new_s:.3f} s/step over {proposal.horizon_steps:.0f} steps; moved in "
            f"{seconds:.2f} s (expected {proposal.move_s:.2f})")
    return state, note

  def restored(self, layout: pipeline.PipeLayout) -> None:
    """The run resumed in `layout` (a saved re-plan)."""
    self.replanner.layout = layout

  def summary(self) -> dict:
    return {"replans": self.replanner.moves, "layout": self.layout.to_json()}
