"""Bucket geometry: big and tight buckets, target layouts that move as few units as possible."""

from semijax.balance import buckets as B
from semijax.core import layout as layout_lib


def even(n=4):
  return layout_lib.Layout.for_model(d_model=32, num_heads=8, d_ff=64, num_devices=n)


def test_bucket_layout_and_rebalance():
  big = B.bucket_layout(even(), 2.0, 4)
  assert big.mlp.capacity == 32 and big.mlp.counts == (16, 16, 16, 16)
  assert big.heads.capacity == 4 and big.mlp.widths == (8, 16, 24, 32)
  new = B.rebalance(big, {"mlp": (4, 20, 20, 20), "heads": (2, 2, 2, 2)})
  assert new.mlp.counts == (4, 20, 20, 20) and new.mlp.capacity == 32
  # Only the 12 surplus units of device 0 moved; the others kept theirs.
  for d in (1, 2, 3):
    assert set(big.mlp.owned[d]) <= set(new.mlp.owned[d])
  assert sorted(u for o in new.mlp.owned for u in o) == list(range(64))
  # The tight bucket of the even split: capacity 16, the big bucket's widths below it.
  tight = B.tight_layout(big)
  assert tight.mlp.capacity == 16 and tight.mlp.widths == (8, 16)
  assert tight.mlp.owned == big.mlp.owned
  assert B.bucket_like(tight, new).mlp.capacity == 32
  assert B.bucket_like(tight, new).mlp.owned == tight.mlp.owned


def test_buckets_target_goes_big_for_uneven_and_back_for_even():
  b = B.Buckets.dynamic(even(), 2.0, 4, tight=True)
  assert B.capacities(b.start) == {"mlp": 16, "heads": 2} and not b.single
  uneven = b.target(b.start, {"mlp": (4, 20, 20, 20), "heads": (2, 2, 2, 2)})
  assert B.capacities(uneven) == {"mlp": 32, "heads": 4} and not b.is_start(uneven)
  back = b.target(uneven, {"mlp": (16, 16, 16, 16), "heads": (2, 2, 2, 2)})
  assert b.is_start(back) and back.mlp.counts == (16, 16, 16, 16)
  # The bucket is the start's; the owners need not be (units came back to other devices).
  assert back.bucket() == b.start.bucket()
  warm = b.warm_target(b.start)
  assert not b.is_start(warm) and sorted(warm.mlp.counts) == [15, 16, 16, 17]


def test_own_widths_and_shift_one():
  uneven = layout_lib.Layout.for_model(d_model=32, num_heads=8, d_ff=64, num_devices=4,
                                       mlp=(10, 30, 4, 20))
  assert B.own_widths(uneven).mlp.widths == (4, 10, 20, 30)
  assert B.shift_one((10, 30, 4, 20), 32) == (10, 29, 5, 20)
  assert B.shift_one((16, 16), 16) == (16, 16)          # nothing fits: unchanged
