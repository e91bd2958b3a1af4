"""How the contributions of one round are combined: SSAW's adaptive weights, and async's none.

A round applies one optimizer update built from K contributions; contribution i is the mean
gradient of n_i samples, computed on parameters `staleness` s_i updates older than the ones it
is applied to (0 = fresh). The rules (`combine`):

  ssaw    weight w_i = n_i * discount(s_i); the update's direction is the weighted mean
          sum_i w_i g_i / sum_i w_i, and its learning rate is the schedule's (at the samples
          applied so far) times (sum_i w_i / batch_size)^lr_batch_power (default power 0: every
          round is a full optimizer step).
  async   every contribution counts by its samples alone (no staleness discount), at the full
          learning rate: the plain bounded-staleness asynchronous baseline.

Why these weights. Samples: a contribution of 2 microbatches says twice as much about the
gradient as one of 1, so the mean over samples is the unbiased estimate (with fresh, equal
contributions it is exactly the synchronous global-batch gradient). Staleness: a gradient
computed s updates ago points where the model was; the staleness-aware asynchronous SGD of
Zhang et al. (IJCAI 2016) divides its step by s, and FedAsync (Xie et al. 2019) weights by
(1 + s)^-a: "poly" with power 1 is that rule, and it keeps a fresh gradient at weight 1.
Learning rate: Adam normalizes the update, so the round's sample count and staleness set only
the direction's weights and every round steps at the scheduled rate (lr_batch_power 0). The
alternative measured in experiments/bench_ssaw.py scales the rate by the square root of the
covered (discounted) share of a batch (Adam's square-root scaling rule, Malladi et al. 2022;
lr_batch_power 0.5): it trains more conservatively per round and ended 0.3% further from sync's
loss at the same samples in this repository's runs (docs/benchmarks.md, "SSAW").
"""

from __future__ import annotations

import dataclasses

import numpy as np

from semijax.sync import settings as settings_lib


def discount(staleness, settings: settings_lib.SyncSettings) -> np.ndarray:
  """float64 [K]: the staleness discount in (0, 1] of each contribution (1 when fresh)."""
  s = np.asarray(staleness, np.float64)
  if settings.mode == "async" or settings.weighting == "samples":
    return np.ones_like(s)
  if settings.weighting == "exp":
    return settings.staleness_decay ** s
  return (1.0 + s) ** -settings.staleness_power


@dataclasses.dataclass(frozen=True)
class Combination:
  """How one round combines its contributions.

  Attributes:
    weights: float64 [K], the direction's weights (sum 1; 0 for an empty contribution).
    lr_scale: the factor on the scheduled learning rate of this update.
    samples: the samples the round applies (every one counts, whatever its weight).
  """

  weights: np.ndarray
  lr_scale: float
  samples: int


def combine(samples, staleness, batch_size: int,
            settings: settings_lib.SyncSettings) -> Combination:
  """The weights and learning-rate scale of one round (see module doc).

  Args:
    samples: int [K], samples of each contribution (> 0 for at least one).
    staleness: int [K], updates between the parameters each was computed on and the ones it is
      applied to.
    batch_size: the global batch (a full synchronous step's samples).
    settings: the run's `SyncSettings` (mode ssaw or async).
  """
  n = np.asarray(samples, np.float64)
  if n.sum() <= 0:
    raise ValueError(f"samples: a round needs at least one sample, got {list(samples)}")
  w = n * discount(staleness, settings)
  scale = 1.0
  if settings.mode == "ssaw":
    scale = float((w.sum() / batch_size) ** settings.lr_batch_power)
  return Combination(w / w.sum(), scale, int(n.sum()))
