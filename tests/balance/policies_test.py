"""Each balancing policy on its own: buckets, fixed schedules and compiled variants.

No engine is built and nothing trains: a policy is host logic over layouts and setups. What
the controlled policies propose and choose at each decision is in controller_test.py.
"""

import pytest

from semijax.balance import buckets as buckets_lib
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
