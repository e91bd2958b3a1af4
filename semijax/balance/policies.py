"""Balancing policies as objects: who computes how much in each step, and what warm-up compiles.

Every policy answers three questions, and nothing else tests a policy's name:

  * `buckets(configured layout)`: the capacity buckets it lives in (`balance.buckets`);
  * `step_kinds(bucket)`: the compiled train-step variants it may run in a bucket, one list used
    by warm-up (which compiles and exercises each) and by the per-step plan (which refuses any
    other): "single" (every device executes one width: no per-device branches), "branched"
    (a `lax.switch` over the bucket's widths), "resized" (ZERO-resizing), "offload";
  * what to compute: a fixed schedule (`keep`), or, for the controlled policies, the candidate
    setups of each decision (`candidates`) and how to choose among them (`choose`).

  even     plain TP: every device owns an equal share, nothing moves;
  static   the configured layout, plus any fixed `config.resize` schedule;
  resize   ZERO-resizing only: slow devices keep `balance.resize_keep` of their units while slow;
  migrate  migration only: ownership follows the measured speeds (cost-benefit, hysteresis);
  offload  the authors' baseline: slow devices' surplus units computed by helpers every step;
  semi     SEMI-migration: exact, resize or migrate, whichever the cost model predicts fastest.

A new policy is a class here and an entry in `REGISTRY`.
"""

from __future__ import annotations

from typing import ClassVar

from semijax.balance import buckets as buckets_lib
from semijax.balance import resize as resize_spec_lib
from semijax.balance import settings as settings_lib
from semijax.balance.cost import Setup
from semijax.core import layout as layout_lib
from semijax.core import plan as plan_lib

STEP_KINDS = ("single", "branched", "resized", "offload")


class Policy:
  """A fixed layout computed exactly (the base of every policy; `static` without a schedule).

  Class attributes say what the policy may do: `moves` (migrate ownership), `resizes`
  (ZERO-resize), `offloads` (helpers compute a slow device's units), `controlled` (measure speeds
  and decide online, with a `balance.controller.Controller`).

  Args:
    settings: the run's `BalanceSettings`.
    schedule: a fixed resize schedule (`static` only), or None.
    epoch_steps: steps per epoch of the schedule (its rotation period).
  """

  name: ClassVar[str] = "static"
  moves: ClassVar[bool] = False
  offloads: ClassVar[bool] = False
  controlled: ClassVar[bool] = False
  resizes: bool = False

  def __init__(self, settings: settings_lib.BalanceSettings,
               schedule: resize_spec_lib.ResizeSpec | None = None, epoch_steps: int = 1):
    self.settings = settings
    self.schedule = schedule if schedule is not None and schedule.scheduled else None
    self.epoch_steps = epoch_steps

  # --- buckets and compiled variants ----------------------------------------------------------

  def buckets(self, configured: layout_lib.Layout) -> buckets_lib.Buckets:
    """The buckets of a run that starts from the `configured` layout."""
    if self.resizes:
      return buckets_lib.Buckets.fixed(configured)
    # A fixed split executes exactly its counts: compile only those widths.
    return buckets_lib.Buckets.fixed(buckets_lib.own_widths(configured))

  def bucket_layouts(self, buckets: buckets_lib.Buckets) -> list[layout_lib.Layout]:
    """One layout of each bucket this policy may run in (only a moving policy leaves the
    start)."""
    return buckets.layouts() if self.moves else [buckets.start]

  def step_kinds(self, bucket: layout_lib.Layout,
                 buckets: buckets_lib.Buckets) -> tuple[str, ...]:
    """The train-step variants this policy may run in `bucket`'s capacity bucket (see module)."""
    kinds = []
    start = buckets.is_start(bucket)
    if start and plan_lib.uniform_widths(buckets.start) is not None:
      kinds.append("single")
    if not kinds or (self.moves and buckets.single):
      kinds.append("branched")
    if self.resizes:
      kinds.append("resized")
    if self.offloads:
      kinds.append("offload")
    return tuple(kinds)

  # --- what to compute ------------------------------------------------------------------------

  def keep(self, step: int, num_devices: int) -> tuple | None:
    """Keep ratios [N] of 0-based `step` under a fixed schedule, or None (exact)."""
    if self.schedule is None:
      return None
    keep = self.schedule.keep_ratios(step, num_devices, self.epoch_steps)
    return None if all(k >= 1 for k in keep) else keep

  def candidates(self, controller, speeds, expected_steps: float) -> dict:
    """{name: Setup} the controller may switch to now, besides "exact" (controlled policies)."""
    del controller, speeds, expected_steps
    return {}

  def choose(self, controller, options) -> tuple[str, str]:
    """(candidate name, reason) among `options` (a `controller.Options`)."""
    return controller.choose_with_hysteresis(options)


class Static(Policy):
  """The configured layout, plus any fixed `config.resize` schedule."""

  name = "static"

  def __init__(self, settings, schedule=None, epoch_steps: int = 1):
    super().__init__(settings, schedule, epoch_steps)
    self.resizes = self.schedule is not None


class Even(Policy):
  """Plain TP: the even split (config validation refuses another layout for it)."""

  name = "even"


class Controlled(Policy):
  """A policy that measures speeds and lets a controller decide (resize, migrate, offload, semi).

  It starts in the tight bucket of the even split and migrates into the big one
  (`balance.capacity_factor`).
  """

  controlled = True

  def buckets(self, configured: layout_lib.Layout) -> buckets_lib.Buckets:
    s = self.settings
    return buckets_lib.Buckets.dynamic(configured, s.capacity_factor, s.num_widths or max(
        len([w for w in u.widths if w]) for u in configured.kinds().values()),
        tight=not self.offloads, zero=self.moves and s.drain)

  def initial_setup(self, layout: layout_lib.Layout) -> Setup:
    return Setup.of({k: u.counts for k, u in layout.kinds().items()})


class Resize(Controlled):
  """ZERO-resizing only: every slow device keeps `resize_keep` of its units while it is slow, and
  computes everything again as soon as nobody is (the authors' setting, no hysteresis)."""

  name = "resize"
  resizes = True

  def candidates(self, controller, speeds, expected_steps):
    s = self.settings
    slow = [v < s.slow_threshold for v in speeds]
    if not any(slow):
      return {}
    owned = controller.setup.owned
    return {"resize": Setup(owned, owned, tuple(s.resize_keep if d else 1.0 for d in slow))}

  def choose(self, controller, options):
    choice = "resize" if "resize" in options.candidates else "exact"
    return choice, (f"resize policy: {'resize' if choice == 'resize' else 'nobody slow'}; "
                    f"{options.context}")


class Migrate(Controlled):
  """Migration only: ownership follows the measured speeds when a move pays."""

  name = "migrate"
  moves = True

  def candidates(self, controller, speeds, expected_steps):
    target = controller.target_counts(speeds)
    if target == controller.setup.owned:
      return {}
    return {"migrate": Setup(target, target, None)}


class Offload(Controlled):
  """The authors' baseline: ownership stays, helpers compute a slow device's surplus every step."""

  name = "offload"
  offloads = True

  def candidates(self, controller, speeds, expected_steps):
    target = controller.target_counts(speeds)
    if target == controller.setup.owned:
      return {}
    return {"offload": Setup(controller.setup.owned, target, None)}


class Semi(Controlled):
  """SEMI-migration: exact, resize or migrate, whichever the cost model predicts fastest.

  Resizing costs accuracy (the controller charges the learning a resized step skips), so it is a
  candidate only within the skip budget (`skip_budget`, at most `resize_budget` of a device's
  units), and only while a migration does not pay yet (a lasting slowdown is migrated, not
  resized; one too short to amortize a move is resized), or for slowdowns expected to end
  within `resize_horizon_steps` (0 by default: a migration that pays, even one waiting out its
  dwell, is not bridged by resized steps)."""

  name = "semi"
  moves = True
  resizes = True

  def candidates(self, controller, speeds, expected_steps):
    out = {}
    owned = controller.setup.owned
    target = controller.target_counts(speeds)
    if target != owned:
      out["migrate"] = Setup(target, target, None)
    keep = controller.equalizing_keep(owned, speeds)
    if keep is not None:
      resize = Setup(owned, owned, keep)
      short = expected_steps <= self.settings.resize_horizon_steps
      if ((short or not controller.migration_pays(out.get("migrate"), speeds, expected_steps))
          and controller.within_skip_budget(resize)):
        out["resize"] = resize
    return out


REGISTRY = {p.name: p for p in (Even, Static, Resize, Migrate, Offload, Semi)}


def make(settings: settings_lib.BalanceSettings, schedule=None, epoch_steps: int = 1) -> Policy:
  """The policy `settings.policy` names."""
  return REGISTRY[settings.policy](settings, schedule, epoch_steps)
