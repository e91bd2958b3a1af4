"""Batches made one step ahead: steps in order come from the worker thread, others are made on
the spot, an error surfaces where the batch is asked for, and close ends the thread."""

import threading

import pytest

from semijax.train import prefetch


def test_steps_in_order_are_made_ahead_on_the_worker_and_others_on_the_spot():
  made = []

  def make(step):
    made.append((step, threading.current_thread().name))
    return {"step": step}

  p = prefetch.Prefetch(make)
  try:
    assert [p.get(s)["step"] for s in (0, 1, 2, 7, 8)] == [0, 1, 2, 7, 8]
  finally:
    p.close()
  where = dict(made)
  main = threading.current_thread().name
  assert where[0] == main and where[7] == main                 # nothing ahead of them
  assert all(where[s].startswith("semijax-batches") for s in (1, 2, 8))


def test_an_error_making_a_batch_is_raised_by_get_and_close_ends_the_thread():
  def make(step):
    if step == 2:
      raise FileNotFoundError("shard 2")
    return step

  p = prefetch.Prefetch(make)
  assert p.get(1) == 1
  with pytest.raises(FileNotFoundError, match="shard 2"):
    p.get(2)
  p.close()
  assert not any(t.name.startswith("semijax-batches") and t.is_alive()
                 for t in threading.enumerate())
