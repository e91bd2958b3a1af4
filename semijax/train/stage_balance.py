"""A pipelined run's online re-planning (`balance.policy = "semi"` with `mesh.pipe` > 1 or a
plan): every `balance.probe_every` steps (every step when the speeds are emulated) the devices'
speeds are sampled, `balance.replan` decides whether moving layers between stages and units
inside them, or re-splitting the batch between data-parallel pipelines, pays, and the state
moves (`core.pipeline.PipelineEngine.move`: weights and Adam moments together, between the
compiled slots and widths; a new split moves nothing, the executor arranges the next batches
into it). Warm-up compiles every migration program such a move may run (`core.pipeline_moves`)
and times a move of each kind there and back (`replan.trials`), so a re-plan compiles nothing
and its first move is priced at what it takes.

Where the speeds come from:
  * emulated (`hetero.device_speeds`, shifted by one device id every `hetero.rotate_every`
    steps): the emulation sleeps each step's time at that step's speeds and each move's
    transfers over the emulated links; the time model is the emulation's;
  * measured (no emulation): `balance.probe.Probe` times the model's MLP block on every device
    of the mesh at once (sized to `balance.probe_budget` of the time between samples unless
    `balance.probe_repeats` is set; the median of the last `balance.probe_window` samples). The
    time model is the plan's devices at speed 1 over free links, at the measured relative
    speeds, scaled so that the current layout's prediction is the measured step time.
"""

from __future__ import annotations

import collections
import time

import jax
import numpy as np

from semijax.balance import probe as probe_lib
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


def plan_text(layout: pipeline.PipeLayout, microbatches) -> str:
  """`layout_text`, and the microbatches per pipeline where there are several."""
  split = f"; microbatches {','.join(map(str, microbatches))}" if len(microbatches) > 1 else ""
  return layout_text(layout) + split


class ProbedSpeeds:
  """Relative speeds [D] of the plan's devices, timed by the probe (see module doc).

  Args:
    run: the validated run (`balance`'s probe settings, the model).
    setup: its plan (which device sits at each mesh position) and engine.
  """

  def __init__(self, run: config_lib.RunConfig, setup: setup_lib.Setup):
    b, plan = run.balance, setup.plan
    devices = jax.devices()
    self.index = {devices[i].id: i for i in plan.device_order}
    self.num_devices = plan.num_devices
    tokens = plan.microbatch_size * run.model.seq_len
    shape = probe_lib.ProbeShape.configured(
        b.probe_size, probe_lib.ProbeShape.of_block(run.model, tokens, plan.tensor))
    self.probe = probe_lib.Probe(shape, max(1, b.probe_repeats),
                                 [devices[i] for i in plan.device_order])
    self.budget = b.probe_budget * b.probe_every if b.probe_repeats == 0 else None
    self.recent = collections.deque(maxlen=b.probe_window)

  def warm_up(self) -> None:
    self.probe.warm_up()

  def sample(self, step_s: float) -> np.ndarray:
    """float [D]: relative speeds (fastest 1; idle devices 1), the median of the window; the
    first sample sizes the probe to its budget of `step_s`-long steps."""
    if self.budget is not None:
      pass_s = max(self.probe.pass_seconds().values())
      self.probe.set_repeats(probe_lib.passes_for(self.budget * step_s, pass_s))
      self.budget = None
    times = np.full(self.num_devices, np.nan)          # idle devices: as fast as the fastest
    for device_id, seconds in self.probe.measure().items():
      times[self.index[device_id]] = seconds
    times = np.nan_to_num(times, nan=np.nanmin(times))
    self.recent.append(times / times.min())
    return 1.0 / np.median(np.stack(self.recent), axis=0)

  def close(self) -> None:
    self.probe.close()


class StageBalancer:
  """Samples speeds, asks the `replan.Replanner` and moves the state (see module doc).

  Args:
    run: the validated run (`balance`, `pipeline.rotate_every`, `steps`).
    setup: its plan, engine, start layout, emulation (or None: the probe measures) and time
      model (`pipeline_setup.build`).
  """

  def __init__(self, run: config_lib.RunConfig, setup: setup_lib.Setup):
    self.engine, self.emulator = setup.engine, setup.emulator
    b = run.balance
    self.every = 1 if setup.emulator is not None else b.probe_every
    self.rotate = run.pipeline.rotate_every
    self.replanner = replan_lib.Replanner(
        setup.time_model, setup.layout, setup.plan.microbatches, run.steps,
        hysteresis=b.hysteresis, min_dwell_steps=b.min_dwell_steps, speed_alpha=b.speed_alpha,
        change_threshold=b.change_threshold, confirm=b.confirm, most=setup.engine.microbatches)
    self.probed = ProbedSpeeds(run, setup) if setup.emulator is None else None
    self._since = None          # when the steps since the last sample started
    self.compiles = 0           # migration programs the re-plans compiled (none: warm-up did)

  @property
  def layout(self) -> pipeline.PipeLayout:
    return self.replanner.layout

  @property
  def microbatches(self) -> tuple[int, ...]:
    """[R] the microbatches of each pipeline now."""
    return self.replanner.microbatches

  def describe(self) -> str:
    source = "emulated speeds" if self.probed is None else "the probe's speeds"
    every = "every step" if self.every == 1 else f"every {self.every} steps"
    moves = ", ".join(f"{k} {s:.3f} s" for k, s in self.replanner.overhead_s.items())
    return f"re-planning on {source} {every}; a move takes {moves or '(none timed)'}"

  def due(self, step: int) -> bool:
    """Whether 0-based `step` ends with a sample (and maybe a move)."""
    return (step + 1) % self.every == 0

  def speeds_at(self, step: int) -> np.ndarray:
    """float [D]: the emulated devices' speeds in 0-based `step`."""
    return self.emulator.devices.speeds_at(step, self.rotate)

  def warm_up(self, state):
    """(state, migration programs compiled): compiles every move of the layout's bucket, times
    one move of each kind there and back (`replan.trials`; the state returns exactly) and warms
    the probe up."""
    compiled = self.engine.compile_moves(state, self.layout)
    for kind, there in replan_lib.trials(self.layout).items():
      t0 = time.perf_counter()
      state = self.engine.move(state, self.layout, there, donate=True)
      state = jax.block_until_ready(self.engine.move(state, there, self.layout, donate=True))
      self.replanner.timed(kind, (time.perf_counter() - t0) / 2)
    if self.probed is not None:
      self.probed.warm_up()
    self._since = time.perf_counter()
    return state, compiled

  def after_step(self, step: int, state):
    """(state, note or None): on a sampling step, the state moved to a re-plan that pays. The
    step time it decides on is the mean since the last sample (or warm-up), which holds the
    steps that ran ahead too."""
    if not self.due(step):
      return state, None
    now = time.perf_counter()
    step_s = (now - (self._since or now)) / self.every
    self._since = now
    if self.probed is None:
      speeds, scale = self.speeds_at(step), 1.0
    else:
      speeds = self.probed.sample(step_s)
      scale = step_s / self.replanner.seconds(self.layout, speeds)
    proposal = self.replanner.observe(step, speeds, step_s, scale=scale)
    if proposal is None:
      return state, None
    old, split, migrator = self.layout, self.microbatches, self.engine.migrator()
    t0, before = time.perf_counter(), migrator.compile_count
    if proposal.layout != old:
      state = jax.block_until_ready(self.engine.move(state, old, proposal.layout, donate=True))
    self.compiles += migrator.compile_count - before
    emulation.Emulator.sleep(proposal.link_s if self.probed is None else 0.0)
    self._since = time.perf_counter()
    seconds = self._since - t0
    self.replanner.moved(step, proposal, seconds)
    note = (f"re-plan after step {step + 1}: {plan_text(old, split)} -> "
            f"{plan_text(proposal.layout, self.microbatches)}; predicted {proposal.now_s:.3f} -> "
            f"{proposal.new_s:.3f} s/step over {proposal.horizon_steps:.0f} steps; moved in "
            f"{seconds:.2f} s (expected {proposal.move_s:.2f})")
    return state, note

  def restored(self, layout: pipeline.PipeLayout, microbatches: tuple[int, ...]) -> None:
    """The run resumed in `layout` with `microbatches` [R] per pipeline (a saved re-plan)."""
    self.replanner.layout, self.replanner.microbatches = layout, tuple(microbatches)

  def close(self) -> None:
    if self.probed is not None:
      self.probed.close()

  def summary(self) -> dict:
    return {"replans": self.replanner.moves, "replan_compiles": self.compiles,
            "layout": self.layout.to_json(), "microbatches": list(self.microbatches)}
