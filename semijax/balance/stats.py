"""The statistics of a balancer's run: what it counted, and the summary it reports at the end.

`Stats` counts migrations, speed samples, decisions and the XLA compilations inside training
steps (`core.compiles`: deciding, migrating, the step, measuring), which must be none after
warm-up; `Stats.summary` reports them with the rest of the compilations after warm-up
(evaluation and checkpoint writing, outside the hot path) and the overheads of measuring and
deciding.
"""

from __future__ import annotations

from semijax.core import compiles
from semijax.core import layout as layout_lib


class Stats:
  """The counters of one balancer's run (see module doc).

  Attributes:
    counts: {name: number}: migrations and their seconds (migrate_s); speed samples (probes)
      and their seconds (probe_s), the probe's passes (probe_passes, once sized); decisions,
      their seconds (decide_s) and the changes among them; XLA compilations inside training
      steps (step_compiles); steps whose plan has one width per kind (single_width_steps).
  """

  def __init__(self):
    self.counts = {"migrations": 0, "migrate_s": 0.0, "probe_s": 0.0, "probes": 0,
                   "decide_s": 0.0, "changes": 0, "step_compiles": 0, "decisions": 0,
                   "single_width_steps": 0}
    self._compiles_before = None    # the compile count when the current step began

  def add(self, **amounts) -> None:
    """Adds `amounts` {name: number} to the counters."""
    for name, amount in amounts.items():
      self.counts[name] += amount

  def step_begins(self) -> None:
    """Notes the compile count as a training step begins (before deciding and migrating)."""
    self._compiles_before = compiles.count()

  def step_ends(self) -> None:
    """Counts the compilations since `step_begins` as the step's (step_compiles)."""
    if self._compiles_before is not None:
      self.counts["step_compiles"] += compiles.count() - self._compiles_before

  def summary(self, policy: str, layout: layout_lib.Layout, *, move_s: float | None,
              compiles_at_warmup: int | None, total_s: float) -> dict:
    """Balance statistics of the run.

    `compiles_after_warmup`: XLA compilations inside training steps (deciding, migrating, the
    step, measuring) after warm-up; `compiles_elsewhere`: the rest after warm-up (evaluation
    and checkpoint writing, e.g. Orbax's per-device slices), outside the hot path.

    Args:
      policy: the policy's name.
      layout: the current layout (its counts are reported).
      move_s: the cost model's seconds of a migration, or None without a controller.
      compiles_at_warmup: the compile count when warm-up ended, or None before.
      total_s: wall seconds of the training steps (the overheads are shares of it, if > 0).
    """
    after = None if compiles_at_warmup is None else compiles.count() - compiles_at_warmup
    out = {"policy": policy, "compiles_after_warmup": self.counts["step_compiles"],
           "compiles_elsewhere": None if after is None else after - self.counts["step_compiles"],
           "move_s": move_s,
           "layout_counts": {k: list(u.counts) for k, u in layout.kinds().items()},
           **self.counts}
    if total_s > 0:
      out["measure_overhead"] = self.counts["probe_s"] / total_s
      out["decide_overhead"] = self.counts["decide_s"] / total_s
    return out
