"""Layout validation, packing and splitting (host-side; nothing is compiled)."""

import jax.numpy as jnp
import numpy as np
import pytest

from semijax.core import layout as L


def test_even_counts_and_widths():
  u = L.UnitLayout.even("mlp", 10, 4)
  assert u.counts == (3, 3, 2, 2)
  assert u.capacity == 3 and u.widths == (1, 2, 3)
  assert L.default_widths(64) == (16, 32, 48, 64)
  assert L.default_widths(10) == (3, 5, 8, 10)


def test_proportional_counts_follow_speed_and_sum():
  counts = L.proportional_counts(256, [1, 1, 1, 0.25, 1, 1, 1, 1])
  assert sum(counts) == 256
  assert counts[3] == min(counts) and 8 <= counts[3] <= 10
  assert max(counts) - min(c for i, c in enumerate(counts) if i != 3) <= 1
  assert L.proportional_counts(8, [1e-9, 1]) == (1, 7)   # minimum one unit


def test_pack_unpack_roundtrip_uneven_and_permuted():
  u = L.UnitLayout(kind="heads", num_units=5, owned=((4,), (), (0, 3, 1), (2,)), capacity=4,
                   active=(1, 0, 2, 1), widths=(2, 4))
  x = np.arange(3 * 5 * 2, dtype=np.float32).reshape(3, 10)    # 5 heads of size 2 on axis 1
  p = np.asarray(u.pack(x, axis=1, unit_size=2))
  assert p.shape == (3, 4 * 4 * 2)
  blocks = p.reshape(3, 4, 4, 2)                                 # [.., device, slot, unit]
  np.testing.assert_array_equal(blocks[:, 0, 0], x[:, 8:10])     # device 0 slot 0 = unit 4
  np.testing.assert_array_equal(blocks[:, 2, 1], x[:, 6:8])      # device 2 slot 1 = unit 3
  assert not blocks[:, 1].any() and not blocks[:, 0, 1:].any()   # padding is zero
  np.testing.assert_array_equal(np.asarray(u.unpack(p, axis=1, unit_size=2)), x)
  assert u.executed_widths() == (2, 2, 2, 2)
  np.testing.assert_array_equal(u.owned_mask().reshape(4, 4).sum(1), [1, 0, 3, 1])
  np.testing.assert_array_equal(u.active_mask().reshape(4, 4).sum(1), [1, 0, 2, 1])


def test_json_roundtrip():
  lay = L.Layout.for_model(d_model=16, num_heads=4, d_ff=20, num_devices=4,
                           mlp=(2, 4, 6, 8), heads=(1, 1, 1, 1), capacity={"mlp": 10})
  assert L.Layout.from_json(lay.to_json()) == lay
  assert lay.mlp.capacity == 10 and lay.bucket()[0] == ("mlp", 10, (3, 5, 8, 10))


@pytest.mark.parametrize("kwargs, field", [
    (dict(mlp=(4, 4, 4)), "layout.mlp: 3 counts"),
    (dict(mlp=(5, 5, 5, 4)), "layout.mlp: counts (5, 5, 5, 4) sum to 19"),
    (dict(heads=(2, 2, 0, 1)), "layout.heads: counts (2, 2, 0, 1) sum to 5"),
    (dict(mlp="uneven"), "layout.mlp: 'uneven' is not 'even'"),
    (dict(capacity={"mlp": 4}), "layout.mlp.capacity: device 0 owns 5 units, more than capacity 4"),
    (dict(capacity={"ffn": 4}), "layout.capacity: unknown kinds ['ffn']"),
    (dict(num_heads=3), "model.num_heads: 3 heads do not divide the model width d_model=16"),
])
def test_layout_errors_name_the_field(kwargs, field):
  args = dict(d_model=16, num_heads=4, d_ff=20, num_devices=4)
  args.update(kwargs)
  with pytest.raises(L.LayoutError) as e:
    L.Layout.for_model(**args)
  assert str(e.value).startswith(field), str(e.value)


@pytest.mark.parametrize("changes, field", [
    (dict(owned=((0, 1), (1, 2), (3,))), "layout.mlp.owned: unit 1 is owned by devices 0 and 1"),
    (dict(owned=((0, 1), (2, 3), (9,))), "layout.mlp.owned: device 2 owns unit 9"),
    (dict(owned=((0, 1), (2,), (3,))), "layout.mlp.counts: owned counts (2, 1, 1) sum to 4"),
    (dict(active=(2, 3, 1)), "layout.mlp.active: device 1 has active=3, outside [0, owned=2]"),
    (dict(active=(2, 2)), "layout.mlp.active: 2 entries for 3 devices"),
    (dict(widths=(1, 3)), "layout.mlp.widths: (1, 3) must be distinct ascending"),
    (dict(widths=(2, 1, 4)), "layout.mlp.widths"),
    (dict(capacity=1), "layout.mlp.capacity: device 0 owns 2 units, more than capacity 1"),
])
def test_unit_layout_errors_name_the_field(changes, field):
  good = L.UnitLayout.from_counts("mlp", (2, 2, 1), capacity=4)
  with pytest.raises(L.LayoutError) as e:
    good.replace(**changes)
  assert str(e.value).startswith(field), str(e.value)


def test_unknown_bucket_is_refused():
  lay = L.Layout.for_model(d_model=16, num_heads=4, d_ff=20, num_devices=4)
  other = L.Layout.for_model(d_model=16, num_heads=4, d_ff=20, num_devices=4,
                             capacity={"mlp": 8})
  lay.check_bucket([lay.bucket()])
  with pytest.raises(L.LayoutError, match=r"^layout.capacity: bucket .* is not compiled"):
    other.check_bucket([lay.bucket()])


def test_pack_axis_accepts_traced_index():
  import jax
  u = L.UnitLayout.from_counts("mlp", (1, 3), capacity=3)
  x = jnp.arange(8.0).reshape(2, 4)
  f = jax.jit(lambda x, s: L.pack_axis(x, s, 1, 1, 4))
  np.testing.assert_array_equal(f(x, jnp.asarray(u.slot_units())), np.asarray(u.pack(x, 1)))
