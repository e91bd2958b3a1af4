"""Microbatched pipeline schedules as tick tables, and what one step of a pipeline costs.

A pipeline of S stages runs M microbatches in lockstep *ticks*. In each tick every stage runs at
most one forward and at most one backward (of any microbatches), then two ppermutes over the
`pipe` axis carry the forward outputs s -> s+1 and the input cotangents s -> s-1. A schedule is
the tick table `table[t, s] = (f, b)`: the microbatch stage s runs forward / backward in tick t,
-1 for none. Its rules (the engine executes exactly this):

  * F(s, m) runs in a tick after the tick of F(s-1, m) (its input arrives with that tick's
    ppermute);
  * B(s, m) runs in a tick after B(s+1, m) and after F(s, m), except on the last stage, where
    B(S-1, m) may share F(S-1, m)'s tick (the loss's backward right after its forward);
  * every stage runs F and B of every microbatch exactly once, microbatches in order.

Two schedules (`SCHEDULES`), each with the fewest ticks its rules allow:

  gpipe  every forward before any backward on each stage, the backwards in reverse microbatch
         order (as autodiff of a forward loop runs them): F(s, m) in tick s + m and
         B(s, m) in tick (S + M - 2) + (M - 1 - m) + (S - 1 - s). Only the last microbatch's
         backward shares its forward's tick on the last stage (any other backward there would
         precede a forward). T = 2 (S + M) - 3 ticks; stage s stashes M microbatches
         (the last stage M - 1).
  1f1b   one-forward-one-backward: warm-up forwards, then a forward and a backward per tick
         where the stash allows, then cool-down backwards, with at most S - s microbatches in
         flight on stage s (forward done, backward not, counted between ticks). Built greedily,
         tick by tick: every stage runs its next backward as soon as its dependencies allow
         and its next forward as soon as its input is there and the in-flight bound holds after
         the tick. The greedy's tick count equals the fewest ticks the rules allow (the tests
         check it against a breadth-first search over all schedules for small S and M).

In lockstep a tick lasts as long as its slowest stage, so 1f1b's bound costs time when S >= 3:
stage s's microbatch needs 2 (S - 1 - s) ticks to come back, so stage 0 can start only
S / (2 S - 2) microbatches per tick (gpipe and an unbounded stash start one per tick). 1f1b is
the choice when gpipe's stash of M microbatches does not fit.

`step_time` is the time model of one step that the planner (`semijax.planner`) predicts and the
emulation of slow devices and links sleeps: per tick, the slowest stage's compute plus the
slowest of the tick's transfers. Everything here is host-side numpy.
"""

from __future__ import annotations

import numpy as np

SCHEDULES = ("gpipe", "1f1b")


def _check_sizes(schedule: str, num_stages: int, num_microbatches: int) -> None:
  if schedule not in SCHEDULES:
    raise ValueError(f"schedule: {schedule!r} is not one of {SCHEDULES}")
  for name, v in (("num_stages", num_stages), ("num_microbatches", num_microbatches)):
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
      raise ValueError(f"{name}: must be an integer >= 1, got {v!r}")


def table(schedule: str, num_stages: int, num_microbatches: int) -> np.ndarray:
  """The tick table of `schedule` (see module doc).

  Args:
    schedule: "gpipe" or "1f1b".
    num_stages: S >= 1; num_microbatches: M >= 1.

  Returns:
    int32 [T, S, 2]: entry [t, s] = (forward microbatch, backward microbatch) of stage s in
    tick t, -1 for none.
  """
  _check_sizes(schedule, num_stages, num_microbatches)
  s, m = int(num_stages), int(num_microbatches)
  return _gpipe(s, m) if schedule == "gpipe" else _one_f_one_b(s, m)


def _gpipe(num_stages: int, num_microbatches: int) -> np.ndarray:
  s_, m_ = num_stages, num_microbatches
  out = np.full((2 * (s_ + m_) - 3, s_, 2), -1, np.int32)
  for s in range(s_):
    for m in range(m_):
      out[s + m, s, 0] = m
      out[(s_ + m_ - 2) + (m_ - 1 - m) + (s_ - 1 - s), s, 1] = m
  return out


def _one_f_one_b(num_stages: int, num_microbatches: int) -> np.ndarray:
  s_, m_ = num_stages, num_microbatches
  f_tick = np.full((s_, m_), -1, np.int64)        # the tick of F(s, m), -1 before it runs
  b_tick = np.full((s_, m_), -1, np.int64)
  nf, nb = [0] * s_, [0] * s_                     # forwards / backwards done per stage
  rows = []
  t = 0
  while min(nb) < m_:
    row = np.full((s_, 2), -1, np.int32)
    for s in range(s_):
      bm, fm = nb[s], nf[s]
      back = (bm < m_ and 0 <= f_tick[s, bm] < t
              and (s == s_ - 1 or 0 <= b_tick[s + 1, bm] < t))
      fwd = (fm < m_ and (s == 0 or 0 <= f_tick[s - 1, fm] < t)
             and (fm + 1) - (bm + back) <= s_ - s)
      if fwd:
        f_tick[s, fm], row[s, 0] = t, fm
        nf[s] += 1
      if not back and fwd and s == s_ - 1 and bm == fm:
        back = True                               # the loss's backward in its forward's tick
      if back:
        b_tick[s, bm], row[s, 1] = t, bm
        nb[s] += 1
    rows.append(row)
    t += 1
  return np.stack(rows)


def _check_table(tab) -> np.ndarray:
  tab = np.asarray(tab)
  if tab.ndim != 3 or tab.shape[2] != 2 or tab.shape[0] < 1 or tab.shape[1] < 1:
    raise ValueError(f"table: need an int array [T, S, 2], got shape {tab.shape}")
  return tab


def in_flight(tab: np.ndarray) -> np.ndarray:
  """int [S]: the most microbatches each stage holds between ticks (forward done, backward not):
  the activations it must stash."""
  tab = _check_table(tab)
  held = np.cumsum(tab[..., 0] >= 0, axis=0) - np.cumsum(tab[..., 1] >= 0, axis=0)
  return held.max(axis=0).astype(np.int64)


def _stage_vector(name: str, x, size: int) -> np.ndarray:
  x = np.asarray(x, np.float64)
  if x.ndim < 1 or x.shape[-1] != size:
    raise ValueError(f"{name}: need [..., {size}] seconds, got shape {x.shape}")
  if not np.all(np.isfinite(x)) or np.any(x < 0):
    raise ValueError(f"{name}: seconds must be finite and >= 0")
  return x


def step_time(tab: np.ndarray, f_s, b_s, send_f, send_b):
  """Seconds of one step of one pipeline in lockstep ticks.

  Sum over ticks of [ max over stages of (f_s[s] if s runs a forward in that tick, plus b_s[s]
  if it runs a backward) + max over the tick's transfers (send_f[s] for s -> s+1 after stage
  s < S-1 ran a forward; send_b[s-1] for s -> s-1 after stage s > 0 ran a backward; 0 if none) ].

  Args:
    tab: int [T, S, 2] tick table (`table`).
    f_s, b_s: float [S] (or [..., S], a batch of pipelines) forward / backward seconds of one
      microbatch on each stage.
    send_f, send_b: float [S-1] (or [..., S-1]) seconds of one microbatch's transfer over
      boundary s -> s+1 (activations) and s+1 -> s (cotangents).

  Returns:
    The seconds (a float; an array [...] for batched inputs).
  """
  tab = _check_table(tab)
  n = tab.shape[1]
  f_s, b_s = _stage_vector("f_s", f_s, n), _stage_vector("b_s", b_s, n)
  send_f = _stage_vector("send_f", send_f, n - 1) if n > 1 else np.zeros(f_s.shape[:-1] + (0,))
  send_b = _stage_vector("send_b", send_b, n - 1) if n > 1 else np.zeros(f_s.shape[:-1] + (0,))
  fwd = (tab[..., 0] >= 0).astype(np.float64)                     # [T, S]
  bwd = (tab[..., 1] >= 0).astype(np.float64)
  compute = (fwd * f_s[..., None, :] + bwd * b_s[..., None, :]).max(axis=-1)       # [..., T]
  if n > 1:
    sends = np.maximum(fwd[:, :-1] * send_f[..., None, :],
                       bwd[:, 1:] * send_b[..., None, :]).max(axis=-1)             # [..., T]
    compute = compute + sends
  total = compute.sum(axis=-1)
  return float(total) if np.ndim(total) == 0 else total


def bubble(tab: np.ndarray, f_s, b_s) -> float:
  """The idle share of stage-time in the compute part of a step: 1 - (work the stages do) /
  (S x the sum over ticks of the slowest stage's compute). Transfers are left out. f_s, b_s:
  float [S] seconds per microbatch."""
  tab = _check_table(tab)
  n = tab.shape[1]
  f_s, b_s = _stage_vector("f_s", f_s, n), _stage_vector("b_s", b_s, n)
  fwd, bwd = tab[..., 0] >= 0, tab[..., 1] >= 0
  work = fwd * f_s + bwd * b_s                                     # [T, S]
  span = n * work.max(axis=1).sum()
  return 0.0 if span <= 0 else float(1.0 - work.sum() / span)
