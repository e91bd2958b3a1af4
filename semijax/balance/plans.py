"""The plan of every step: which compiled variant it runs, built on the device once and cached.

A step's plan follows from its layout and setup (`cost.Setup`): a resized setup runs the
"resized" variant, an offloaded one the "offload" variant, an exact one the "single"-width
variant where the policy compiled it for this bucket and every device executes one width, else
the "branched" one. `PlanCache` refuses a variant the policy did not list for the bucket
(`policies.Policy.step_kinds`): warm-up compiled exactly that list, so a missing entry would be
a compile on the hot path.
"""

from __future__ import annotations

from semijax.balance import buckets as buckets_lib
from semijax.balance.cost import Setup
from semijax.core import layout as layout_lib
from semijax.core import offload as offload_lib
from semijax.core import plan as plan_lib

# Plans kept before the cache is cleared. A plan is a few small device arrays; distinct plans
# come from (layout, keep ratios, offload) combinations, which a run revisits (a rotating
# straggler cycles through N of them), so 64 covers every run here many times over while
# bounding what a pathological run could accumulate.
PLAN_CACHE_SIZE = 64


def offload_for(layout: layout_lib.Layout, computed: dict) -> dict:
  """The offload description that makes each device compute `computed` {kind: counts}."""
  return {k: offload_lib.for_target(u, computed[k]) for k, u in layout.kinds().items()}


class PlanCache:
  """Builds and caches the device plans of a run's steps (see module doc).

  Args:
    engine: the run's `core.engine.Engine`.
    policy: the run's policy (its `step_kinds`).
    buckets: the run's `buckets.Buckets`.
  """

  def __init__(self, engine, policy, buckets: buckets_lib.Buckets):
    self.engine, self.policy, self.buckets = engine, policy, buckets
    self._plans: dict = {}
    self._variants = None    # (layout, its `kinds`, whether it has `uniform_widths`)

  def kinds(self, layout: layout_lib.Layout) -> tuple[str, ...]:
    """The variants the policy may run in `layout`'s bucket."""
    return self.policy.step_kinds(layout, self.buckets)

  def kind(self, layout: layout_lib.Layout, setup: Setup) -> str:
    """The variant a step of `setup` in `layout` runs (RuntimeError if it was not warmed up)."""
    if self._variants is None or self._variants[0] is not layout:   # a run keeps its layout
      self._variants = (layout, self.kinds(layout), plan_lib.uniform_widths(layout) is not None)
    _, kinds, uniform = self._variants
    if setup.keep is not None:
      want = "resized"
    elif setup.offloaded:
      want = "offload"
    elif "single" in kinds and uniform:
      want = "single"
    else:
      want = "branched"
    if want not in kinds:
      raise RuntimeError(f"balance: policy {self.policy.name!r} runs no {want!r} step in bucket "
                         f"{layout.bucket()} (its variants there: {kinds}); it would compile "
                         "on the hot path")
    return want

  @staticmethod
  def _arguments(layout: layout_lib.Layout, kind: str, setup: Setup, resize) -> dict:
    """`Engine.plan` / `plan.executed_widths` keyword arguments of variant `kind`."""
    if kind == "single":
      return {"widths": plan_lib.uniform_widths(layout)}
    if kind == "offload":
      return {"offload": offload_for(layout, setup.computed)}
    return {"resize": resize if kind == "resized" else None}

  def build(self, layout: layout_lib.Layout, kind: str, setup: Setup,
            resize=None) -> plan_lib.Plan:
    """The device plan of variant `kind` for `layout` (uncached; warm-up uses it directly)."""
    return self.engine.plan(layout, **self._arguments(layout, kind, setup, resize))

  def plan(self, layout: layout_lib.Layout, setup: Setup, resize=None,
           resize_version: int = 0) -> tuple[plan_lib.Plan, dict]:
    """(device plan, {kind: executed widths [N, L]}) of a step, cached: the same inputs give the
    same device arrays."""
    kind = self.kind(layout, setup)
    computed = tuple(sorted(setup.computed.items())) if kind == "offload" else None
    key = (layout, kind, setup.keep, computed, resize_version if kind == "resized" else None)
    if key not in self._plans:
      if len(self._plans) >= PLAN_CACHE_SIZE:
        self._plans.clear()
      args = self._arguments(layout, kind, setup, resize)
      self._plans[key] = (self.engine.plan(layout, **args), plan_lib.executed_widths(
          layout, self.engine.num_layers, kernel=self.engine.kernel, **args))
    return self._plans[key]
