"""The balancing policy of a training run: what every step computes, and when work moves.

`Balancer` sits in the training loop (semijax/train.py). Before each step it returns the plan
(and, after a migration, the migrated state); after each step it takes the measured time. What it
does depends on `config.balance.policy`:

  even     plain TP: every device owns an equal share, nothing moves;
  static   the configured layout (`config.layout`), plus any `config.resize` schedule;
  resize   ZERO-resizing only: slow devices keep `balance.resize_keep` of their units while slow;
  migrate  migration only: ownership follows the measured speeds (cost-benefit, hysteresis);
  offload  the authors' baseline: slow devices' surplus units computed by helpers every step;
  semi     SEMI-migration: the controller picks exact / resize / migrate online.

Buckets: `resize`, `migrate` and `semi` start in the tight bucket of the even split (capacity =
the even share, `tight_layout`); a migration to an uneven split moves the state into the big
bucket (`balance.capacity_factor` times the even share, `bucket_layout`) with one re-layout, and a
migration back to even returns it to the tight one; inside the big bucket units move with the
migration collective. `offload` runs in the big bucket throughout. Every variant a policy may
need in either bucket (the exact step, the resized step, the offload step, the moves, the speed
probe) is compiled during warm-up and nothing compiles afterwards; `compiles_after_warmup` counts
XLA compilations (`semijax.compiles`) after `warm_up`. Warm-up also runs every branch of those
steps once on a throwaway state (`Engine.exercise`): XLA:CPU pays about 0.2 s the first time a
branch runs, which would otherwise land on the first step after each change.

While every device executes the same width (the even split), exact steps run the single-width
step (`plan_lib.uniform_widths`): no per-device branches, no rematerialization.

Speeds come from `speed.Probe` timings shared between processes, or, with emulated heterogeneity,
from the emulated slowdown profile (`config.hetero.slowdown`, optionally rotating every
`config.hetero.rotate_every` steps). Every decision goes to workdir/decisions.jsonl with its
reason, predicted and measured step times.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import time

import jax
import numpy as np
from absl import logging

from semijax import models
from semijax.balance import controller as controller_lib
from semijax.balance import priority as priority_lib
from semijax.balance import speed as speed_lib
from semijax.core import compiles
from semijax.core import emulation as hetero
from semijax.core import layout as layout_lib
from semijax.core import migrate as migrate_lib
from semijax.core import offload as offload_lib
from semijax.core import plan as plan_lib

DYNAMIC = ("resize", "migrate", "offload", "semi")


def slowdown_at(profile, step: int, rotate_every: int):
  """The emulated slowdown [N] in 0-based `step`: `profile` shifted by one device every
  `rotate_every` steps (0 = static), so (8, 1, ..., 1) gives the authors' rotating straggler."""
  if profile is None:
    return None
  if not rotate_every:
    return tuple(profile)
  shift = (step // rotate_every) % len(profile)
  return tuple(np.roll(np.asarray(profile, float), shift).tolist())


def bucket_layout(layout: layout_lib.Layout, factor: float, num_widths: int) -> layout_lib.Layout:
  """`layout` (same owners) in a bucket of capacity ceil(factor * U / N) per kind (at most
  U - N + 1, at least the largest count), with `num_widths` compute widths."""
  kinds = {}
  for kind, u in layout.kinds().items():
    n = u.num_devices
    cap = min(u.num_units - n + 1, math.ceil(factor * u.num_units / n))
    cap = max(cap, max(u.counts))
    kinds[kind] = layout_lib.UnitLayout(kind, u.num_units, u.owned, cap, u.counts,
                                        layout_lib.default_widths(cap, num_widths))
  return layout_lib.Layout(**kinds)


def tight_layout(big: layout_lib.Layout) -> layout_lib.Layout:
  """`big` (same owners) at the capacity of its largest count, with the widths of `big` below
  it: the bucket an even split lives in between migrations (no padded slack to update)."""
  kinds = {}
  for kind, u in big.kinds().items():
    cap = max(u.counts)
    kinds[kind] = u.replace(capacity=cap, widths=tuple(w for w in u.widths if w < cap) + (cap,))
  return layout_lib.Layout(**kinds)


def bucket_like(layout: layout_lib.Layout, bucket: layout_lib.Layout) -> layout_lib.Layout:
  """`layout`'s owners at the capacity and widths of `bucket`."""
  return layout_lib.Layout(**{k: u.replace(capacity=bucket.kinds()[k].capacity,
                                           widths=bucket.kinds()[k].widths)
                              for k, u in layout.kinds().items()})


def rebalance(layout: layout_lib.Layout, target: dict) -> layout_lib.Layout:
  """A layout with `target` {kind: counts}, moving as few units as possible: devices above their
  target hand their last units to devices below theirs (same capacity and widths)."""
  moves = {}
  for kind, u in layout.kinds().items():
    want = target[kind]
    surplus = [unit for d, o in enumerate(u.owned) for unit in o[want[d]:][::-1]]
    need = [d for d in range(u.num_devices) for _ in range(max(want[d] - u.counts[d], 0))]
    moves[kind] = list(zip(surplus[::-1], need))
  return migrate_lib.move_units(layout, moves)


class Balancer:
  """Runs `config.balance.policy` in a training loop (see module doc).

  Args:
    config: the run's config; parsed: its `config_lib.Parsed`.
    engine: the run's engine; layout: the layout the state starts in (`initial_layout`).
    workdir: where decisions.jsonl goes (process 0), or None.
    steps_per_epoch: training steps per pass over the data (default priority refresh interval).
  """

  def __init__(self, config, parsed, engine, layout, workdir: str | None, steps_per_epoch: int):
    b = config.balance
    self.policy = parsed.balance.policy
    self.engine, self.layout = engine, layout
    # Migrations leave the tight bucket an even start lives in for the big one, and come back.
    self.big = self.big_layout(config, parsed) if self.policy in DYNAMIC else layout
    if self._caps(self.big) == self._caps(layout):
      self.big = layout
    # Exact steps of a layout whose devices all execute one width run the single-width step.
    self.narrow = plan_lib.uniform_widths(layout)
    self._start = layout
    self.profile, self.rotate_every = parsed.slowdown, int(config.hetero.rotate_every)
    self.schedule = parsed.resize                     # a static config.resize schedule, or None
    self.resize_spec = parsed.resize_how
    self.epoch_steps = self.resize_spec.epoch_steps or steps_per_epoch
    self.refresh_every = self.resize_spec.refresh_every or self.epoch_steps
    m = config.model
    self.priority = None
    if self.schedule is not None or self.policy in ("resize", "semi"):
      self.priority = priority_lib.Priority(
          self.resize_spec, num_layers=m.num_layers, d_model=m.d_model,
          num_units=engine.num_units, unit_sizes=engine.unit_sizes,
          num_devices=layout.num_devices, seed=config.seed)
    self.controller = None
    self.tracker = None
    self.probe = None
    self.migrator = None
    self.measure = b.measure
    if self.measure == "auto":
      self.measure = ("emulated" if self.profile is not None else
                      "sched" if speed_lib.SchedShare.available() else "probe")
    if self.policy in DYNAMIC:
      self.tracker = speed_lib.SpeedTracker(layout.num_devices, alpha=b.alpha,
                                            threshold=b.change_threshold, confirm=b.confirm)
      if self.measure == "probe":
        self.probe = speed_lib.Probe(b.probe_size, b.probe_repeats)
      elif self.measure == "sched":
        self.probe = speed_lib.SchedShare()
      self.controller = controller_lib.Controller(
          parsed.balance, self._cost_model(config), controller_lib.Setup.of(
              {k: u.counts for k, u in layout.kinds().items()}),
          self._caps(self.big), self._unit_bytes())
      if self.policy in ("migrate", "semi"):
        self.migrator = engine.migrator()
    self.probe_every = int(b.probe_every)
    self.decision = None
    self._plans: dict = {}
    self._resize_cache = (None, None)   # (keep, Resize) since the last priority refresh
    self._scores_step = None
    self._resize_version = 0
    self.compiles_at_warmup = None
    self.stats = {"migrations": 0, "migrate_s": 0.0, "probe_s": 0.0, "probes": 0,
                  "decide_s": 0.0, "changes": 0, "step_compiles": 0, "decisions": 0,
                  "single_width_steps": 0}
    self._compiles_before = None
    self._sampled = False        # a new speed sample arrived since the last decision
    self._new_regime = False     # ... and the tracker confirmed a new regime with it
    self._pending = []           # step seconds since the last sample (this process)
    self._last = None            # the latest decision (logged with the time measured after it)
    self.clock_s = 0.0           # shared clock: sum of the shared mean step times
    self._step_s = None
    self._log = None
    if workdir is not None and jax.process_index() == 0 and self.controller is not None:
      os.makedirs(workdir, exist_ok=True)
      self._log = open(os.path.join(workdir, "decisions.jsonl"), "a")

  # --- setup ----------------------------------------------------------------------------------

  @staticmethod
  def big_layout(config, parsed) -> layout_lib.Layout:
    """The configured layout in the dynamic policies' big bucket (`balance.capacity_factor`)."""
    b = config.balance
    return bucket_layout(parsed.layout, b.capacity_factor,
                         b.num_widths or config.layout.num_widths)

  @staticmethod
  def initial_layout(config, parsed) -> layout_lib.Layout:
    """The layout a run of this policy starts in: `resize`, `migrate` and `semi` start in the
    tight bucket (`tight_layout`; migrations switch buckets), `offload` in the big one."""
    layout = parsed.layout
    if parsed.balance.policy in DYNAMIC:
      layout = Balancer.big_layout(config, parsed)
      if parsed.balance.policy != "offload":
        layout = tight_layout(layout)
    elif parsed.resize is None:     # a fixed split executes exactly its counts: compile only those
      layout = layout_lib.Layout(**{k: dataclasses.replace(u, widths=tuple(sorted(set(u.counts))))
                                    for k, u in layout.kinds().items()})
    return layout

  def _cost_model(self, config) -> controller_lib.CostModel:
    m = config.model
    flops = hetero.flops_per_unit(d_model=m.d_model, head_dim=m.d_model // m.num_heads,
                                  seq_len=models.sequence_length(m), causal=models.is_causal(m))
    return controller_lib.CostModel(
        flops, {k: u.widths for k, u in self.big.kinds().items()}, self.engine.num_units,
        fixed_fraction=config.balance.fixed_fraction, alpha=config.balance.alpha,
        narrow=None if self.narrow is None else {k: w[0] for k, w in self.narrow.items()})

  @staticmethod
  def _caps(layout) -> dict:
    return {k: u.capacity for k, u in layout.kinds().items()}

  def _unit_bytes(self) -> dict:
    """{kind: bytes of one unit's weights over all layers} (float32)."""
    out = {}
    for a, shape in zip(jax.tree.leaves(self.engine.axes), jax.tree.leaves(
        self.engine.logical_shapes, is_leaf=lambda x: isinstance(x, tuple))):
      if (unit := a.unit()) is not None:
        axis, kind = unit
        out[kind] = out.get(kind, 0.0) + 4.0 * np.prod(shape) / self.engine.num_units[kind]
    return out

  # --- per step -------------------------------------------------------------------------------

  def slowdown(self, step: int):
    return slowdown_at(self.profile, step, self.rotate_every)

  def keep(self, step: int):
    """Resize keep ratios [N] of 0-based `step`, or None (exact)."""
    if self.controller is not None:
      return self.controller.setup.keep
    if self.schedule is not None:
      keep = self.schedule.keep_ratios(step, self.layout.num_devices, self.epoch_steps)
      return None if all(k >= 1 for k in keep) else keep
    return None

  def _resize(self, step: int, state, keep):
    """The host `Resize` for `keep`, or None. Priority scores are refreshed at every multiple of
    `refresh_every` (and at the first step if never refreshed), as in the authors' code."""
    if self.priority is None:
      return None
    due = step % self.refresh_every == 0 or self.priority.refreshes == 0
    if due and step != self._scores_step:
      params = jax.device_get(self.engine.to_logical(state, self.layout).params)
      self.priority.refresh(params, self.engine.axes, self.layout)
      self._scores_step = step
      self._resize_cache = (None, None)
    if keep is None:
      return None
    cached, resize = self._resize_cache
    if cached != (keep, self.layout):
      resize = self.priority.select(self.layout, keep)
      self._resize_cache = ((keep, self.layout), resize)
      self._resize_version += 1
    return resize

  def _offload_for(self, computed: dict) -> dict:
    """The offload description that makes each device compute `computed` {kind: counts}."""
    return {k: offload_lib.for_target(u, computed[k]) for k, u in self.layout.kinds().items()}

  def plan(self, step: int, state):
    """The plan of 0-based `step` (cached: the same inputs give the same device arrays)."""
    keep = self.keep(step)
    slowdown = self.slowdown(step)
    resize = self._resize(step, state, keep)
    setup = None if self.controller is None else self.controller.setup
    computed = setup.computed if setup is not None and setup.offloaded else None
    key = (self.layout, keep, slowdown, None if computed is None else tuple(computed.items()),
           None if keep is None else self._resize_version)
    if key not in self._plans:
      if len(self._plans) > 64:
        self._plans.clear()
      kw = {} if computed is None else {"offload": self._offload_for(computed)}
      if resize is None and computed is None:
        kw["widths"] = self._exact_widths(self.layout)
      self._plans[key] = self.engine.plan(self.layout, slowdown, resize, **kw)
    return self._plans[key]

  def _exact_widths(self, layout) -> dict | None:
    """The single width of the exact step when `layout` allows it (and warm-up compiled it:
    the starting width and bucket)."""
    uniform = plan_lib.uniform_widths(layout)
    same = uniform is not None and uniform == self.narrow
    return uniform if same and self._caps(layout) == self._caps(self._start) else None

  def before_step(self, step: int, state):
    """(state, plan) for 0-based `step`: decides (after each speed sample), migrates if the
    decision says so. Every input of a decision is identical on all processes (shared samples
    and a shared clock), so all processes take the same decision."""
    self._compiles_before = compiles.count()
    self.decision = None
    if self.controller is not None and self._sampled and self.controller.cost.calibrated:
      self._sampled = False
      t0 = time.perf_counter()
      self.decision = self.controller.decide(
          step, self.tracker.speeds, self.tracker.expected_remaining_s(self.clock_s), self._step_s,
          new_regime=self._new_regime)
      self._new_regime = False
      self.stats["decide_s"] += time.perf_counter() - t0
      self.stats["decisions"] += 1
      if self.decision.changed:
        self.stats["changes"] += 1
        logging.info("balance step %d: %s", step, self.decision.reason)
      if self.decision.moves:
        state = self._migrate(state, self.decision.setup.owned)
    plan = self.plan(step, state)
    self.stats["single_width_steps"] += all(len(w) == 1 for _, w in plan.widths)
    return state, plan

  def _move(self, state, old: layout_lib.Layout, new: layout_lib.Layout):
    """The state moved from layout `old` to `new`: the migration collective inside a bucket,
    a re-layout through the logical form between buckets."""
    if self._caps(new) != self._caps(old):
      return self.engine.relayout(state, old, new)
    return self.migrator.migrate_state(state, migrate_lib.plan(old, new), self.engine.tx,
                                       self.engine.axes)

  def _target_layout(self, counts: dict) -> layout_lib.Layout:
    """The layout with `counts`, moving as few units as possible: in the tight bucket when they
    fit it (the even split), else in the big one."""
    big = rebalance(bucket_like(self.layout, self.big), counts)
    tight = tight_layout(big)
    return tight if self._caps(tight) == self._caps(self._start) else big

  def _migrate(self, state, counts: dict):
    new = self._target_layout(counts)
    t0 = time.perf_counter()
    state = self._move(state, self.layout, new)
    jax.block_until_ready(state)
    dt = time.perf_counter() - t0
    self.stats["migrations"] += 1
    self.stats["migrate_s"] += dt
    self._observe_move(dt)
    self.layout = new
    return state

  def _observe_move(self, seconds: float) -> None:
    """Calibrates the move cost with the slowest process's time (decision inputs are shared)."""
    _, seconds = speed_lib.gather_times({}, seconds)
    self.controller.cost.observe_move(seconds)

  def after_step(self, step: int, step_s: float) -> dict:
    """Takes the measured seconds of 0-based `step`'s train step; returns scalars to log."""
    if self.decision is not None:
      self._last = self.decision
    out = self._after_step(step, step_s)
    if self._compiles_before is not None:
      self.stats["step_compiles"] += compiles.count() - self._compiles_before
    return out

  def _after_step(self, step: int, step_s: float) -> dict:
    """Every `probe_every` steps (every step when emulated): one shared speed sample, the mean
    step time since the last one, the cost model's calibration and the decision's log line."""
    if self.controller is None:
      return {}
    self._pending.append(step_s)
    if self.measure != "emulated" and step % self.probe_every:
      return {}
    t0 = time.perf_counter()
    local = self.probe.measure() if self.probe is not None else {}
    every, mean_s = speed_lib.gather_times(local, float(np.mean(self._pending)))
    if self.probe is not None:
      times = speed_lib.tensor_times(self.engine.mesh, every)
      self.stats["probes"] += 1
    else:
      times = np.asarray(self.slowdown(step), np.float64)
    probe_s = time.perf_counter() - t0
    self.stats["probe_s"] += probe_s
    self.clock_s += mean_s * len(self._pending)
    self._pending = []
    self._new_regime |= self.tracker.update(times, self.clock_s)
    self._sampled = True
    self._step_s = mean_s if self._step_s is None else 0.7 * self._step_s + 0.3 * mean_s
    # Calibrate with this sample's speeds, measured over the same steps (the tracker's smoothed
    # speeds lag a change, and would pair the new step times with the old speeds).
    times = np.asarray(times, np.float64)
    self.controller.cost.observe(self.controller.setup, times.min() / times, mean_s)
    out = {"balance/min_speed": float(np.min(self.tracker.speeds)),
           "balance/measured_s": mean_s, "balance/migrations": self.stats["migrations"]}
    if self._last is not None:      # the latest decision, with what the steps since then took
      d = self._last
      out["balance/predicted_s"] = d.predicted_s.get(d.choice, d.predicted_s["current"])
      out["balance/choice"] = float(controller_lib.CANDIDATE_NAMES.index(d.choice))
      if self._log is not None:
        cost = self.controller.cost
        record = {**d.to_json(), "measured_s": round(mean_s, 6), "sample_s": round(probe_s, 6),
                  "clock_s": round(self.clock_s, 3),
                  "cost": {"fixed_s": round(cost.fixed_s, 5), "per_load_s": round(cost.per_load_s, 5),
                           "move_s": round(cost.move_s, 5)}}
        self._log.write(json.dumps(record) + "\n")
        if d.changed:
          self._log.flush()
    return out

  # --- warm-up and summary --------------------------------------------------------------------

  def warm_up(self, state, batch, eval_batch, step: int = 0):
    """Compiles and exercises every variant this policy may use (in both buckets), times a
    migration, does the priority refresh due at 0-based `step` (the first to run); returns the
    state (unchanged in value, in the starting layout)."""
    engine = self.engine
    self._warm_steps(state, batch, eval_batch, self.layout)
    if self.policy == "offload":
      shifted = {k: _shift_one(u.counts, u.capacity) for k, u in self.layout.kinds().items()}
      off = self._offload_for(shifted)
      engine.compile(state, batch, engine.plan(self.layout, self.slowdown(0), None, offload=off),
                     eval_batch)
    engine.to_logical(state, self.layout)        # checkpoints and priority refreshes
    self._resize(step, state, None)   # a refresh due at the first step (~0.4 s), before the clock
    if self.probe is not None:
      self.probe.warm_up()
    if self.migrator is not None:
      # An uneven split in the big bucket, a migration inside it and back, then home.
      start = self.layout
      there = rebalance(bucket_like(start, self.big),
                        {k: _shift_one(u.counts, u.capacity) for k, u in self.big.kinds().items()})
      state = self._move(state, start, there)
      if there.bucket() != start.bucket():
        self._warm_steps(state, batch, eval_batch, there)
      further = rebalance(there, {k: _shift_one(u.counts, u.capacity)
                                  for k, u in there.kinds().items()})
      state = self._move(state, there, further)
      state = self._move(state, further, there)
      state = self._move(state, there, start)
      jax.block_until_ready(state)
      speed_lib.gather_times({})        # a barrier: time the move, not a process still compiling
      t0 = time.perf_counter()
      state = self._move(state, start, there)      # every move above is compiled: time one
      jax.block_until_ready(state)
      self._observe_move(time.perf_counter() - t0)
      state = self._move(state, there, start)
    if self.probe is not None:   # last: the first sample then measures training steps only
      speed_lib.gather_times(self.probe.measure(), 0.0)
    self.compiles_at_warmup = compiles.count()
    return state

  def _warm_steps(self, state, batch, eval_batch, layout) -> None:
    """Compiles and exercises the train and eval steps this policy may run in `layout`'s bucket."""
    engine = self.engine
    narrow = self._exact_widths(layout)
    variants = [engine.plan(layout, self.slowdown(0), widths=narrow)]
    if narrow is not None and self.migrator is not None and self.big is self._start:
      variants.append(engine.plan(layout, self.slowdown(0)))     # uneven splits in one bucket
    if self.priority is not None:     # a throwaway copy: selecting marks units as seen
      half = tuple(0.5 for _ in range(layout.num_devices))
      resize = copy.deepcopy(self.priority).select(layout, half)
      variants.append(engine.plan(layout, self.slowdown(0), resize))
    for plan in variants:
      engine.compile(state, batch, plan, eval_batch)
      engine.exercise(state, batch, plan)

  def summary(self, total_s: float) -> dict:
    """Balance statistics of the run (`total_s`: wall seconds of the training steps).

    `compiles_after_warmup`: XLA compilations inside training steps (deciding, migrating, the
    step, measuring) after warm-up; `compiles_elsewhere`: the rest after warm-up (evaluation
    and checkpoint writing, e.g. Orbax's per-device slices), outside the hot path.
    """
    after = None if self.compiles_at_warmup is None else compiles.count() - self.compiles_at_warmup
    out = {"policy": self.policy, "compiles_after_warmup": self.stats["step_compiles"],
           "compiles_elsewhere": None if after is None else after - self.stats["step_compiles"],
           "move_s": None if self.controller is None else self.controller.cost.move_s,
           "layout_counts": {k: list(u.counts) for k, u in self.layout.kinds().items()},
           **self.stats}
    if total_s > 0:
      out["measure_overhead"] = self.stats["probe_s"] / total_s
      out["decide_overhead"] = self.stats["decide_s"] / total_s
    return out

  def close(self):
    if self._log is not None:
      self._log.close()
      self._log = None


def _shift_one(counts, capacity) -> tuple:
  """Counts with one unit moved from the largest to the smallest device (a warm-up target)."""
  counts = list(counts)
  hi, lo = int(np.argmax(counts)), int(np.argmin(counts))
  if hi != lo and counts[hi] > 1 and counts[lo] < capacity:
    counts[hi] -= 1
    counts[lo] += 1
  return tuple(counts)
