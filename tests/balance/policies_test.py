"""Each balancing policy on its own: buckets, compiled variants, candidates and choices.

No engine is built and nothing trains: a policy is host logic over layouts and setups.
"""

import numpy as np
import pytest

from semijax.balance import buckets as buckets_lib
from semijax.balance import controller as ctl
from semijax.balance import cost as cost_lib
from semijax.balance import policies
from semijax.balance import resize as resize_spec_lib
from semijax.balance import settings as settings_lib
from semijax.core import layout as layout_lib

N = 4


def configured(mlp="even"):
  return layout_lib.Layout.for_model(d_model=32, num_heads=8, d_ff=64, num_devices=N, mlp=mlp)


def make(name, schedule=None, **kw):
  settings = settings_lib.BalanceSettings(policy=name, **kw).validate(policies.REGISTRY)
  return policies.make(settings, schedule, epoch_steps=10)


def kinds_by_bucket(policy, layout):
  b = policy.buckets(layout)
  return [policy.step_kinds(x, b) for x in policy.bucket_layouts(b)]


def test_registry_names_every_policy():
  assert sorted(policies.REGISTRY) == ["even", "migrate", "offload", "resize", "semi", "static"]
  for name, cls in policies.REGISTRY.items():
    assert isinstance(make(name), cls) and make(name).name == name


@pytest.mark.parametrize("name, start_caps, big_caps, kinds", [
    # Fixed layouts: one bucket at exactly the counts' width.
    ("even", (16, 2), (16, 2), [("single",)]),
    ("static", (16, 2), (16, 2), [("single",)]),
    # Dynamic: the tight bucket of the even split, the big one (2x) for uneven splits.
    ("migrate", (16, 2), (32, 4), [("single",), ("branched",)]),
    ("resize", (16, 2), (32, 4), [("single", "resized")]),      # never moves: one bucket
    ("semi", (16, 2), (32, 4), [("single", "resized"), ("branched", "resized")]),
    # Offload keeps ownership in the big bucket throughout.
    ("offload", (32, 4), (32, 4), [("single", "offload")]),
])
def test_buckets_and_compiled_variants(name, start_caps, big_caps, kinds):
  policy = make(name)
  b = policy.buckets(configured())
  assert tuple(buckets_lib.capacities(b.start).values()) == start_caps
  assert tuple(buckets_lib.capacities(b.big).values()) == big_caps
  assert kinds_by_bucket(policy, configured()) == kinds
  if name in ("even", "static"):
    assert b.start.mlp.widths == (16,)       # a fixed split compiles only its own width


def test_static_variants_follow_the_split_and_the_schedule():
  uneven = configured(mlp=(10, 30, 4, 20))
  policy = make("static")
  assert kinds_by_bucket(policy, uneven) == [("branched",)]
  assert policy.buckets(uneven).start.mlp.widths == (4, 10, 20, 30)
  schedule = resize_spec_lib.ResizeSpec(straggler="rotate", straggler_keep=0.5).validate(N)
  scheduled = make("static", schedule)
  assert kinds_by_bucket(scheduled, configured()) == [("single", "resized")]
  # The schedule rotates the straggler every epoch (10 steps here).
  assert scheduled.keep(0, N) == (0.5, 1.0, 1.0, 1.0)
  assert scheduled.keep(25, N) == (1.0, 1.0, 0.5, 1.0)
  assert policy.keep(0, N) is None


def test_one_bucket_when_the_big_bucket_is_the_tight_one():
  # capacity_factor 1: uneven splits live in the start bucket, which then compiles the
  # branched step beside the single-width one.
  policy = make("semi", capacity_factor=1.0)
  b = policy.buckets(configured())
  assert b.single and b.start == b.big
  assert kinds_by_bucket(policy, configured()) == [("single", "branched", "resized")]


# --- candidates and choices on a controller (no engine) ------------------------------------


OWNED = {"mlp": (16, 16, 16, 16), "heads": (2, 2, 2, 2)}
SLOW = (0.25, 1.0, 1.0, 1.0)
EVEN = (1.0, 1.0, 1.0, 1.0)


def controller(name, **kw):
  policy = make(name, **kw)
  b = policy.buckets(configured())
  cost = cost_lib.CostModel({"mlp": 1.0, "heads": 10.0},
                            {k: u.widths for k, u in b.big.kinds().items()},
                            {"mlp": 64, "heads": 8}, move_s=0.1)
  cost.observe(cost_lib.Setup.of(OWNED), SLOW, 1.0)
  return ctl.Controller(policy, policy.settings, cost, policy.initial_setup(b.start),
                        buckets_lib.capacities(b.big))


def test_candidates_of_each_policy():
  assert controller("resize").policy.candidates(controller("resize"), EVEN, 100) == {}
  c = controller("resize", resize_keep=0.25)
  assert c.policy.candidates(c, SLOW, 100)["resize"].keep == (0.25, 1.0, 1.0, 1.0)
  c = controller("migrate")
  target = c.policy.candidates(c, SLOW, 100)["migrate"]
  assert target.owned == target.computed and target.owned["mlp"][0] < 16
  assert sum(target.owned["mlp"]) == 64 and max(target.owned["mlp"]) <= 32
  c = controller("offload")
  off = c.policy.candidates(c, SLOW, 100)["offload"]
  assert off.owned == OWNED and off.computed["mlp"][0] < 16 and off.offloaded
  c = controller("semi", resize_horizon_steps=8, skip_budget=0.9)
  within, beyond = c.policy.candidates(c, SLOW, 5), c.policy.candidates(c, SLOW, 50)
  assert set(within) == {"resize", "migrate"} and set(beyond) == {"migrate"}
  c = controller("semi", resize_horizon_steps=8)
  assert set(c.policy.candidates(c, SLOW, 5)) == {"migrate"}   # default skip budget: none yet
  assert within["resize"].keep[0] < 1 and within["resize"].keep[1:] == (1.0, 1.0, 1.0)
  assert c.policy.candidates(c, EVEN, 5) == {}


def test_resize_policy_chooses_without_hysteresis():
  c = controller("resize", patience=5)
  assert c.decide(0, SLOW, expected_s=100, step_s=1.0).choice == "resize"
  assert c.decide(1, EVEN, expected_s=100, step_s=1.0).choice == "exact"


def test_semi_resizes_then_migrates():
  c = controller("semi", patience=1, resize_horizon_steps=8, skip_budget=0.9)
  c.cost.move_s = 1.0       # a move that 2 steps cannot amortize
  first = c.decide(0, SLOW, expected_s=2.0, step_s=1.0, new_regime=True)
  assert first.choice == "resize" and not first.moves
  later = c.decide(10, SLOW, expected_s=100.0, step_s=1.0)
  assert later.choice == "migrate" and later.moves
  assert np.argmin(later.setup.owned["mlp"]) == 0
