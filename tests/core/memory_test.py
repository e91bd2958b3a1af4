"""No device ever holds the whole state: the sharded logical form, migrations that switch
buckets, checkpoints and priority refreshes stay near what a device holds in steady training.

A 4-layer GPT on 8 tensor devices. `semijax.core.memory` measures, per device, the live array
shards plus each program's own output and temporary bytes (XLA's per-device memory analysis).
Before this design, the logical state was replicated: every device held all of it during a
bucket switch, a checkpoint and a priority refresh (8x the steady share here, with the moments).
"""

import gc
import os

import jax
import numpy as np
import optax
import pytest

import helpers as H
from semijax.balance import buckets as buckets_lib
from semijax.balance import priority as priority_lib
from semijax.balance import resize as resize_spec_lib
from semijax.core import engine as engine_lib
from semijax.core import layout as L
from semijax.core import memory
from semijax.core import mesh as mesh_lib
from semijax.models import gpt
from semijax.models import tasks
from semijax.train import checkpoint as checkpoint_lib

N = 8
KW = dict(vocab_size=64, seq_len=8, d_model=64, num_heads=8, d_ff=256, num_layers=4)
BOUND = 1.3


@pytest.fixture(scope="module")
def eng():
  mesh = mesh_lib.make_mesh(1, N)
  return engine_lib.Engine(lambda rngs: gpt.GPT(rngs=rngs, **KW), tasks.language_model, mesh,
                           optax.adamw(1e-2))


def held():
  gc.collect()
  return int(memory.held_bytes().max())


def whole_state_bytes(state) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(state))


def priority(eng):
  spec = resize_spec_lib.ResizeSpec(priority="weight_delta").validate(N)
  return priority_lib.Priority(spec, num_layers=KW["num_layers"], d_model=KW["d_model"],
                               num_units=eng.num_units, unit_sizes=eng.unit_sizes,
                               num_devices=N)


def test_switch_checkpoint_and_refresh_stay_near_the_steady_state(eng, tmp_path):
  even = L.Layout.for_model(d_model=KW["d_model"], num_heads=KW["num_heads"], d_ff=KW["d_ff"],
                            num_devices=N)
  b = buckets_lib.Buckets.dynamic(even, 2.0, 4, tight=True)      # tight start, 2x big bucket
  start = b.start
  uneven = b.target(start, {"mlp": (8, 40, 36, 36, 36, 36, 32, 28),
                            "heads": (1, 1, 1, 1, 1, 1, 1, 1)})
  assert not b.is_start(uneven)
  state = eng.init(0, start)                       # built sharded: no replicated copy first
  pr = priority(eng)
  pr.refresh(state.params, eng.axes, start)        # the snapshot: part of the steady state
  steady_tight = held()

  with memory.peak() as switch:                    # tight -> big, through the collective
    state = eng.move(state, start, uneven, donate=True)
    pr.move_snapshot(lambda t: eng.move(t, start, uneven, donate=True))
  steady = held()                                  # steady training in the big bucket
  assert steady > steady_tight and switch.programs > 0

  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"))
  with memory.peak() as save:                      # the loop's checkpoint: through logical
    logical = eng.to_logical(state, uneven, donate=True)
    ckpt.save(1, logical, {"data_position": 1})
    state = eng.to_padded(logical, uneven, donate=True)
  with memory.peak() as refresh:
    pr.refresh(state.params, eng.axes, uneven)
  ckpt.close()

  whole = whole_state_bytes(state)
  for name, meter in (("bucket switch", switch), ("checkpoint save", save),
                      ("priority refresh", refresh)):
    assert meter.peak <= BOUND * steady, (name, meter.peak / steady)
  # What the replicated logical state used to put on every device.
  assert whole > 4 * steady


def test_a_model_too_big_to_replicate_trains_moves_checkpoints_and_restores(eng, tmp_path):
  # A per-device budget of half the whole state: the whole state (what the replicated
  # logical form put on every device) does not fit it; the state of every operation here does,
  # the big bucket of an uneven split included (the training steps' own activations and
  # gradients are not state and not counted).
  even = L.Layout.for_model(d_model=KW["d_model"], num_heads=KW["num_heads"], d_ff=KW["d_ff"],
                            num_devices=N)
  other = H.random_layout(3, N, model="gpt").replace(
      mlp=L.UnitLayout.from_counts("mlp", (60, 20, 28, 28, 28, 28, 32, 32), capacity=64))
  batch = eng.shard_batch({"inputs": np.zeros((4, KW["seq_len"]), np.int32),
                           "targets": np.zeros((4, KW["seq_len"]), np.int32)})
  with memory.peak() as init:
    state = eng.init(0, even)
  budget = whole_state_bytes(state) // 2
  ckpt = checkpoint_lib.Checkpointer(str(tmp_path / "ckpt"))
  with memory.peak() as run:
    for _ in range(2):
      state, _ = eng.train_step(state, batch, eng.plan(even))
    state = eng.move(state, even, other, donate=True)
    state, _ = eng.train_step(state, batch, eng.plan(other))
    logical = eng.to_logical(state, other, donate=True)
    ckpt.save(3, logical, {"data_position": 3})
    del logical, state
    restored, _ = ckpt.restore(eng.abstract_logical(), 3)
    state = eng.to_padded(restored, even, donate=True)
  ckpt.close()
  assert init.peak <= budget and run.peak <= budget
  assert jax.tree.leaves(state)[0].shape == jax.tree.leaves(eng.init(0, even))[0].shape
