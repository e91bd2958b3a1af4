"""The balancer of a training run: the one object the loop calls before and after each step.

`Balancer` wires the parts of the balancing layer together (`parts.build` makes them from a
run's config); each does one job:

  policy      (`policies`) what may change and what is compiled for it;
  buckets     (`buckets`) the capacity buckets and the layout of a target split;
  plans       (`plans`) the device plan of each step, from the warmed-up variants only;
  resizer     (`priority.Resizer`) priority refreshes and the `Resize` of resized steps;
  controller  (`controller`, `cost`) decisions of the controlled policies;
  sampler     (`sampling`) shared speed samples and the shared clock;
  mover       (`mover`) migrations between layouts;
  log         (`decisions`) workdir/decisions.jsonl;
  warmer      (`warmup`) the warm-up: compiling, exercising and timing before the first step;
  stats       (`stats`) the run's counters and its summary.

Before each step, `before_step` decides (after a new speed sample), migrates if the decision
says so, and returns the plan; after it, `after_step` takes the measured time. `warm_up` compiles
and exercises every variant the policy may use, in every bucket, and times a migration, so that
nothing compiles afterwards: `summary()["compiles_after_warmup"]` counts XLA compilations inside
training steps after warm-up (`core.compiles`).
"""

from __future__ import annotations

import time

import numpy as np
from absl import logging

from semijax.balance import buckets as buckets_lib
from semijax.balance import controller as controller_lib
from semijax.balance import decisions as decisions_lib
from semijax.balance import mover as mover_lib
from semijax.balance import parts as parts_lib
from semijax.balance import plans as plans_lib
from semijax.balance import policies as policies_lib
from semijax.balance import priority as priority_lib
from semijax.balance import sampling as sampling_lib
from semijax.balance import stats as stats_lib
from semijax.balance import warmup as warmup_lib
from semijax.balance.cost import Setup
from semijax.core import compiles


# The cost model of a controlled run (`parts.cost_model`), by the name `sim.stage` calls it.
cost_model = parts_lib.cost_model


class Balancer:
  """Runs a balancing policy in a training loop (see module doc).

  Args:
    engine: the run's engine.
    policy: a `policies.Policy`.
    buckets: the policy's buckets for the configured layout.
    hetero: the slowdown profile (`core.emulation.Hetero`; a sampler's speeds when emulated).
    emulator: a `core.emulation.Emulator` for an emulated slowdown, else None.
    resizer: a `priority.Resizer` for policies that resize, else None.
    controller, sampler: for controlled policies, else None.
    log: a `decisions.DecisionLog`, or None.
  """

  def __init__(self, engine, policy: policies_lib.Policy, buckets: buckets_lib.Buckets, hetero,
               *, emulator=None, resizer: priority_lib.Resizer | None = None,
               controller: controller_lib.Controller | None = None,
               sampler: sampling_lib.SpeedSampler | None = None,
               log: decisions_lib.DecisionLog | None = None):
    self.engine, self.policy, self.buckets, self.hetero = engine, policy, buckets, hetero
    self.emulator = emulator
    self.delay_s = 0.0              # the emulated slowdown of the current step
    self.layout = buckets.start
    self.plans = plans_lib.PlanCache(engine, policy, buckets)
    self.mover = mover_lib.Mover(engine) if policy.moves else None
    self.resizer, self.controller, self.sampler = resizer, controller, sampler
    self.warmer = warmup_lib.WarmUp(engine, buckets, self.plans, mover=self.mover,
                                    resizer=resizer, controller=controller, sampler=sampler,
                                    emulator=emulator)
    self.log = log or decisions_lib.DecisionLog(None)
    self.decision = None            # the decision taken before the current step, if any
    self.compiles_at_warmup = None
    self.stats = stats_lib.Stats()
    self._sample = None             # a speed sample not yet decided on
    self._new_regime = False        # ... some sample since the last decision confirmed a regime
    self._last = None               # the latest decision (logged with the time measured after it)

  @classmethod
  def create(cls, engine, *, settings, resize_spec, hetero, spec, layout, workdir: str | None,
             steps_per_epoch: int, seed: int, tokens: int, emulator=None) -> "Balancer":
    """The balancer a run's typed config asks for: its parts from `parts.build` (the same
    arguments, `emulator` aside: the emulated slowdown, `core.emulation.Emulator`, or None)."""
    return cls(engine, hetero=hetero, emulator=emulator, **parts_lib.build(
        engine, settings=settings, resize_spec=resize_spec, hetero=hetero, spec=spec,
        layout=layout, workdir=workdir, steps_per_epoch=steps_per_epoch, seed=seed,
        tokens=tokens))

  # --- per step -------------------------------------------------------------------------------

  def setup(self, step: int) -> Setup:
    """What every device owns and computes in 0-based `step`."""
    if self.controller is not None:
      return self.controller.setup
    counts = {k: u.counts for k, u in self.layout.kinds().items()}
    return Setup(counts, counts, self.policy.keep(step, self.layout.num_devices))

  def before_step(self, step: int, state):
    """(state, plan) for 0-based `step`: decides (after each speed sample), migrates if the
    decision says so. Every input of a decision is identical on all processes (shared samples
    and a shared clock), so all processes take the same decision."""
    self.stats.step_begins()
    self.decision = None
    if self._sample is not None and self.controller.cost.calibrated:
      self._sample = None
      t0 = time.perf_counter()
      self.decision = self.controller.decide(
          step, self.sampler.tracker.speeds, self.sampler.expected_remaining_s(),
          self.sampler.step_s, new_regime=self._new_regime)
      self._new_regime = False
      self.stats.add(decide_s=time.perf_counter() - t0, decisions=1)
      self._last = self.decision
      if self.decision.changed:
        self.stats.add(changes=1)
        logging.info("balance before step %d: %s", step + 1, self.decision.reason)
      if self.decision.moves:
        state = self._migrate(state, self.decision.setup.owned)
    if self.resizer is not None and self.resizer.due(step):
      self._refresh(step, state)
    plan, executed = self._plan(step)
    if self.emulator is not None:
      self.delay_s = self.emulator.delay_s(step, executed)
    self.stats.add(single_width_steps=all(len(w) == 1 for _, w in plan.widths))
    return state, plan

  def _plan(self, step: int):
    """(device plan, executed widths) of 0-based `step` in the current layout and setup."""
    setup = self.setup(step)
    resize, version = None, 0
    if self.resizer is not None:
      resize, version = self.resizer.resize(self.layout, setup.keep), self.resizer.version
    return self.plans.plan(self.layout, setup, resize, version)

  def emulate(self) -> None:
    """Sleeps the emulated slowdown of the step just computed (nothing without emulation)."""
    if self.emulator is not None:
      self.emulator.sleep(self.delay_s)

  def _refresh(self, step: int, state) -> None:
    self.resizer.refresh(step, state.params, self.engine.axes, self.layout)

  def _migrate(self, state, counts: dict):
    new = self.buckets.target(self.layout, counts)
    state, seconds = self.mover.timed_move(
        state, self.layout, new, None if self.resizer is None else self.resizer.priority)
    self.stats.add(migrations=1, migrate_s=seconds)
    self.controller.cost.observe_move(seconds)
    self.layout = new
    return state

  def must_wait(self, step: int) -> bool:
    """Whether 0-based `step` must finish before the next step is planned: an emulated
    straggler sleeps after it, or a speed sample is taken after it. Other steps may run ahead
    (`dispatched` now, `timed` once a later step was waited for)."""
    return self.emulator is not None or (self.sampler is not None and self.sampler.due(step))

  def dispatched(self) -> None:
    """The current step's programs are dispatched: what compiled since `before_step` is the
    step's."""
    self.stats.step_ends()

  def timed(self, step: int, step_s: float) -> dict:
    """Takes the measured seconds of 0-based `step`'s train step (steps in order; a step that
    ran ahead gets its share of the time until the next wait); returns scalars to log."""
    if self.sampler is not None and (sample := self.sampler.after_step(step, step_s)):
      return self._take(sample)
    return {}

  def after_step(self, step: int, step_s: float) -> dict:
    """`dispatched`, then `timed`: for a step that was waited for."""
    self.dispatched()
    return self.timed(step, step_s)

  def _take(self, sample: sampling_lib.Sample) -> dict:
    """A new shared speed sample: calibrates the cost model and logs the latest decision."""
    self._sample = sample
    self._new_regime |= sample.new_regime
    self.stats.add(probe_s=sample.probe_s)
    self.stats.counts["probes"] = self.sampler.samples
    if self.sampler.passes is not None:
      self.stats.counts["probe_passes"] = self.sampler.passes
    # Calibrate with this sample's speeds, measured over the same steps (the tracker's smoothed
    # speeds lag a change, and would pair the new step times with the old speeds).
    cost = self.controller.cost
    cost.observe(self.controller.setup, sample.speeds, sample.mean_s)
    out = {"balance/min_speed": float(np.min(self.sampler.tracker.speeds)),
           "balance/measured_s": sample.mean_s,
           "balance/migrations": self.stats.counts["migrations"]}
    if self._last is not None:      # the latest decision, with what the steps since then took
      d = self._last
      out["balance/predicted_s"] = d.predicted_s.get(d.choice, d.predicted_s["current"])
      out["balance/choice"] = float(controller_lib.CANDIDATE_NAMES.index(d.choice))
      self.log.write({**d.to_json(), "measured_s": round(sample.mean_s, 6),
                      "sample_s": round(sample.probe_s, 6), "clock_s": round(sample.clock_s, 3),
                      "sampled_speeds": [round(float(v), 4) for v in sample.raw_speeds],
                      "cost": {"fixed_s": round(cost.fixed_s, 5),
                               "per_load_s": round(cost.per_load_s, 5),
                               "move_s": round(cost.move_s, 5),
                               "repeat": round(cost.repeat, 4)}}, flush=d.changed)
    return out

  # --- warm-up, checkpoints and summary ---------------------------------------------------------

  def warm_up(self, state, batch, eval_batch, step: int = 0):
    """Compiles and exercises every variant the policy may use in every bucket, compiles and
    times a migration, does the priority refresh due at 0-based `step` (the first to run) and
    takes a trial step's provisional speed sample (`warmup.WarmUp`); returns the state
    (unchanged in value, in the starting layout)."""
    state, sample = self.warmer.warm_up(state, batch, eval_batch, self.layout, step, self._plan)
    if sample is not None:
      self._take(sample)
    self.compiles_at_warmup = compiles.count()
    return state

  def state_dict(self) -> dict | None:
    """Host state for checkpoints (the priority scores), or None."""
    return None if self.resizer is None else {"priority": self.resizer.priority.state_dict()}

  def load_state_dict(self, state: dict | None) -> None:
    if self.resizer is not None and state is not None:
      self.resizer.priority.load_state_dict(state["priority"])

  @property
  def resizes(self) -> bool:
    """Whether the policy resizes (and so keeps a priority, with its snapshot)."""
    return self.resizer is not None

  @property
  def snapshot(self):
    """The priority's device snapshot (padded params in the current layout), or None."""
    return None if self.resizer is None else self.resizer.priority.snapshot

  @snapshot.setter
  def snapshot(self, params) -> None:
    """Keeps `params` as the priority's snapshot (only a policy that `resizes` has one)."""
    self.resizer.priority.snapshot = params

  def summary(self, total_s: float) -> dict:
    """Balance statistics of the run (`stats.Stats.summary`; `total_s`: wall seconds of the
    training steps)."""
    return self.stats.summary(
        self.policy.name, self.layout, compiles_at_warmup=self.compiles_at_warmup,
        move_s=None if self.controller is None else self.controller.cost.move_s, total_s=total_s)

  def close(self) -> None:
    self.log.close()
    if self.sampler is not None:
      self.sampler.close()
