"""The warm-up of a balancer: everything compiled and timed before the first training step.

`WarmUp` compiles and exercises every step variant the policy may use in every bucket
(`policies.Policy.step_kinds`), round-trips the state through its checkpoint form, compiles every
migration the policy may run and times one (the cost model's move cost), and times a trial step
whose provisional speed sample lets the first step already run on a decision. Nothing compiles
after it (`coordinator.Balancer` counts what does).
"""

from __future__ import annotations

import time

import jax

from semijax.balance import buckets as buckets_lib
from semijax.balance import controller as controller_lib
from semijax.balance import mover as mover_lib
from semijax.balance import plans as plans_lib
from semijax.balance import priority as priority_lib
from semijax.balance import sampling as sampling_lib
from semijax.balance.cost import Setup
from semijax.core import layout as layout_lib


class WarmUp:
  """Warms up the parts of one balancer (see module doc).

  Args:
    engine: the run's engine.
    buckets: the policy's `buckets.Buckets`.
    plans: the balancer's `plans.PlanCache`.
    mover: a `mover.Mover` for policies that move, else None.
    resizer: a `priority.Resizer` for policies that resize, else None.
    controller, sampler: for controlled policies, else None.
    emulator: a `core.emulation.Emulator` for an emulated slowdown, else None.
  """

  def __init__(self, engine, buckets: buckets_lib.Buckets, plans: plans_lib.PlanCache, *,
               mover: mover_lib.Mover | None = None,
               resizer: priority_lib.Resizer | None = None,
               controller: controller_lib.Controller | None = None,
               sampler: sampling_lib.SpeedSampler | None = None, emulator=None):
    self.engine, self.buckets, self.plans = engine, buckets, plans
    self.mover, self.resizer, self.controller = mover, resizer, controller
    self.sampler, self.emulator = sampler, emulator

  def warm_up(self, state, batch, eval_batch, layout: layout_lib.Layout, step: int, plan):
    """Compiles and exercises every variant the policy may use in every bucket, compiles and
    times a migration, does the priority refresh due at 0-based `step` (the first to run), then
    times a trial step; `state` is in `layout` (the starting one), `plan` maps a 0-based step
    to its (device plan, executed widths) (`Balancer._plan`). Returns (the state, unchanged in
    value, in `layout`; the trial's provisional `sampling.Sample`, or None without a sampler)."""
    self._steps(state, batch, eval_batch, layout)
    # A checkpoint's round trip through the logical form (and the restore's way back).
    state = self.engine.to_padded(self.engine.to_logical(state, layout, donate=True),
                                  layout, donate=True)
    if self.resizer is not None and self.resizer.due(step):
      self.resizer.refresh(step, state.params, self.engine.axes, layout)  # ~0.4 s, before the clock
    if self.sampler is not None:
      self.sampler.warm_up()
    if self.mover is not None:
      state = self._moves(state, batch, eval_batch, layout)
    sample = None
    if self.sampler is not None:   # last: the first sample then measures training steps only
      self.sampler.start()
      sample = self._trial(state, batch, step, plan)
    return state, sample

  def _trial(self, state, batch, step: int, plan) -> sampling_lib.Sample | None:
    """Times one step in the starting layout on a throwaway copy of `state` (with the emulated
    slowdown) and returns a provisional speed sample of it (`SpeedSampler.trial`): 0-based
    `step`, the first to run, then already runs on a decision, so a run that starts on unequal
    devices moves before its first step instead of after it. Off the clock, like the rest of
    warm-up. Only where warm-up runs scratch steps (`StepPrograms.scratch_runs`: on CPU);
    elsewhere None: the first sample comes after the first step, which runs on the starting
    layout."""
    if not self.engine.programs.scratch_runs:
      return None
    step_plan, executed = plan(step)
    scratch = jax.tree.map(lambda x: x.copy(), state)
    t0 = time.perf_counter()
    _, metrics = self.engine.train_step(scratch, batch, step_plan)
    jax.block_until_ready(metrics)
    if self.emulator is not None:
      self.emulator.sleep(self.emulator.delay_s(step, executed))
    return self.sampler.trial(step, time.perf_counter() - t0)

  def _moves(self, state, batch, eval_batch, start: layout_lib.Layout):
    """An uneven split in the big bucket, a migration inside it and back, then home to `start`;
    then one move timed (every move is compiled by then) to calibrate the cost of migrating."""
    there = self.buckets.warm_target(start)
    move = self.mover.move
    self.mover.compile(state, start, there)           # into the big bucket, every chunk size
    state = move(state, start, there)
    if not self.buckets.is_start(there):
      self._steps(state, batch, eval_batch, there)
    further = buckets_lib.rebalance(there, {k: buckets_lib.shift_one(u.counts, u.capacity)
                                            for k, u in there.kinds().items()})
    self.mover.compile(state, there, further)         # inside it
    self.mover.compile(state, there, start)           # and home
    state = move(move(move(state, there, further), further, there), there, start)
    jax.block_until_ready(state)
    self.mover.shared(0.0)      # a barrier: time the move, not a process still compiling
    t0 = time.perf_counter()
    state = move(state, start, there)
    jax.block_until_ready(state)
    self.controller.cost.observe_move(self.mover.shared(time.perf_counter() - t0))
    return move(state, there, start)

  def _steps(self, state, batch, eval_batch, layout: layout_lib.Layout) -> None:
    """Compiles and exercises the train and eval steps the policy may run in `layout`'s bucket
    (`policies.Policy.step_kinds`), with `state` in `layout`, and the priority refresh."""
    if self.resizer is not None:
      self.resizer.priority.warm_up(state.params, self.engine.axes)
    owned = {k: u.counts for k, u in layout.kinds().items()}
    for kind in self.plans.kinds(layout):
      setup, resize = Setup.of(owned), None
      if kind == "resized":
        half = tuple(0.5 for _ in range(layout.num_devices))
        resize = self.resizer.priority.select(layout, half, mark=False)
      elif kind == "offload":
        setup = Setup(setup.owned, {k: buckets_lib.shift_one(u.counts, u.capacity)
                                    for k, u in layout.kinds().items()})
      plan = self.plans.build(layout, kind, setup, resize)
      # A bucket that may leave a device without units compiles that variant too (`Plan.idle`).
      for p in (plan, plan.with_idle()) if plan.may_idle and not plan.idle else (plan,):
        self.engine.compile(state, batch, p, eval_batch)
        self.engine.exercise(state, batch, p)

