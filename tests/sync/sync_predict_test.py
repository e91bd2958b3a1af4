"""Predicted time per global batch under each mode (`sync.predict`), against closed forms."""

import numpy as np
import pytest

from semijax.sync import predict
from semijax.sync import settings as settings_lib


def test_equal_replicas_cost_the_same_in_every_mode():
  out = predict.predict_all([0.5] * 4)
  assert {m: p.batch_s for m, p in out.items()} == {m: 0.5 for m in settings_lib.MODES}
  assert all(p.mean_staleness == 0 and p.idle_share == 0 for p in out.values())


@pytest.mark.parametrize("times", [(1, 1, 1, 2), (1, 1, 2, 2), (1, 1, 1, 1, 1, 1, 2, 2),
                                   (1, 2), (1, 1, 1, 4)])
def test_ssaw_runs_at_the_replicas_combined_throughput(times):
  # When no replica ever waits, R microbatches (one batch) take R / sum(1 / t_r) seconds.
  out = predict.predict_all(times)
  t = np.asarray(times, float)
  assert out["sync"].batch_s == t.max()
  assert out["ssaw"].batch_s == pytest.approx(len(t) / np.sum(1 / t), rel=0.02)
  assert out["ssaw"].idle_share == pytest.approx(0.0, abs=0.02)
  assert out["ssaw"].mean_staleness > 0
  assert out["local_sgd"].batch_s == t.max()


def test_the_bound_caps_the_gain():
  loose = predict.predict("ssaw", [1, 1, 1, 8], settings=settings_lib.SyncSettings(
      staleness_bound=8))
  tight = predict.predict("ssaw", [1, 1, 1, 8], settings=settings_lib.SyncSettings(
      staleness_bound=1))
  # bound 1: the fast wait for the slow every other round: 2 rounds (7 microbatches) per 8 s.
  assert tight.batch_s == pytest.approx(8 * 4 / 7, rel=0.02)
  assert loose.batch_s < tight.batch_s < 8
  assert tight.idle_share > 0.3


def test_links_cost_every_mode_its_own_way():
  t, comm = [1.0, 1.0, 1.0, 2.0], 0.1
  out = predict.predict_all(t, comm_s=comm, settings=settings_lib.SyncSettings(local_steps=4))
  assert out["sync"].batch_s == pytest.approx(2.1)
  assert out["local_sgd"].batch_s == pytest.approx(2.0 + comm / 4)
  no_links = predict.predict("ssaw", t)
  assert no_links.batch_s < out["ssaw"].batch_s < out["sync"].batch_s


def test_ring_allreduce_time():
  assert predict.ring_allreduce_s(1e9, 1, 1e9) == 0.0
  assert predict.ring_allreduce_s(1e9, 4, 1e9, latency_s=1e-3) == pytest.approx(1.5 + 0.006)


def test_bad_input():
  with pytest.raises(ValueError, match="mode"):
    predict.predict("fast", [1.0])
  with pytest.raises(ValueError, match="replica_s"):
    predict.predict("sync", [1.0, 0.0])
