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
         flight on stage s (forward done, backward not, counted between ticks). Greedy: every
         stage runs its next backward as soon as its dependencies allow and its next forward
         as soon as its input is there and the in-flight bound holds after the tick. The
         greedy's tick count equals the fewest ticks the rules allow (the tests check it
         against a breadth-first search over all schedules for small S and M).

In lockstep a tick lasts as long as its slowest stage, so 1f1b's bound costs time when S >= 3:
stage s's microbatch needs 2 (S - 1 - s) ticks to come back, so stage 0 can start only
S / (2 S - 2) microbatches per tick (gpipe and an unbounded stash start one per tick). 1f1b is
the choice when gpipe's stash of M microbatches does not fit.

`step_time` is the time model of one step that the planner (`semijax.planner`) predicts and the
emulation of slow devices and links sleeps: per tick, the slowest stage's compute plus the
slowest of the tick's transfers. `stage_seconds`, `allreduce_s` and `send_s` give its inputs:
what one microbatch costs a stage (a backward recomputes its forward, then does twice the
forward's work), a ring all-reduce, and one transfer over a link. Everything here is host-side
numpy.
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
  s, m = np.meshgrid(np.arange(num_stages), np.arange(num_microbatches), indexing="ij")
  back = (num_stages + num_microbatches - 2) + (num_microbatches - 1 - m) + (num_stages - 1 - s)
  return _fill(s + m, back)


def _one_f_one_b(num_stages: int, num_microbatches: int) -> np.ndarray:
  """1f1b's greedy, computed per microbatch: each forward and backward in the earliest tick the
  rules and the in-flight bound allow (what the tick-by-tick greedy does, since every rule only
  looks at earlier ticks):

    F(s, m) = max(F(s-1, m) + 1, F(s, m-1) + 1, B(s, m - (S - s)))      (bound: S - s in flight)
    B(s, m) = max(B(s+1, m) + 1, F(s, m) + 1, B(s, m-1) + 1)            (last stage: F(s, m))

  Microbatch m's ticks depend on the S microbatches before it only, so once S consecutive
  microbatches repeat those q before them shifted by P ticks, every later one does too: the
  rest is filled in by that period.
  """
  s_, m_ = num_stages, num_microbatches
  f = np.zeros((s_, m_), np.int64)
  b = np.zeros((s_, m_), np.int64)
  stages = np.arange(s_)
  bound = s_ - stages                            # in flight allowed on each stage
  last = (stages == s_ - 1).astype(np.int64)
  for m in range(m_):
    # F(s, m) = max over s' <= s of (X(s') + s - s'), X the terms besides F(s-1, m) + 1.
    x = np.zeros(s_, np.int64)
    if m > 0:
      x = f[:, m - 1] + 1
    held = m - bound
    ok = held >= 0
    x[ok] = np.maximum(x[ok], b[ok, held[ok]])
    f[:, m] = stages + np.maximum.accumulate(x - stages)
    # B(s, m) = max over s' >= s of (Y(s') + s' - s).
    y = f[:, m] + 1 - last
    if m > 0:
      y = np.maximum(y, b[:, m - 1] + 1)
    b[:, m] = np.maximum.accumulate((y + stages)[::-1])[::-1] - stages
    if m + 1 < m_ and m >= 2 * s_ and (m + 1) % s_ == 0:
      period = _period(f[:, :m + 1], b[:, :m + 1], s_)
      if period:
        q, shift = period
        j = np.arange(1, m_ - m)
        src = m - q + 1 + (j - 1) % q
        step = ((j - 1) // q + 1) * shift
        f[:, m + 1:] = f[:, src] + step
        b[:, m + 1:] = b[:, src] + step
        break
  return _fill(f, b)


def _period(f: np.ndarray, b: np.ndarray, history: int):
  """(q, P) if the last `history` microbatches' ticks are those q before them plus P."""
  m = f.shape[1] - 1
  rows = slice(m - history + 1, m + 1)
  for q in range(1, history + 1):
    shift = f[0, m] - f[0, m - q]
    before = slice(m - history + 1 - q, m + 1 - q)
    if (np.all(f[:, rows] - f[:, before] == shift)
        and np.all(b[:, rows] - b[:, before] == shift)):
      return q, int(shift)
  return None


def _fill(f_tick: np.ndarray, b_tick: np.ndarray) -> np.ndarray:
  """int32 [T, S, 2] from the ticks [S, M] of every forward and backward."""
  s_, m_ = f_tick.shape
  out = np.full((int(b_tick.max()) + 1, s_, 2), -1, np.int32)
  stage = np.broadcast_to(np.arange(s_)[:, None], (s_, m_))
  micro = np.broadcast_to(np.arange(m_)[None, :], (s_, m_))
  out[f_tick, stage, 0] = micro
  out[b_tick, stage, 1] = micro
  return out


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


def allreduce_s(nbytes: float, members: int, latency_s: float, bandwidth: float) -> float:
  """Seconds of a ring all-reduce of `nbytes` (bytes per member) among `members` over links of
  `latency_s` seconds and `bandwidth` bytes/s: 0 for one member, else
  2 (N-1) latency + 2 (N-1)/N nbytes / bandwidth (N-1 reduce-scatter and N-1 all-gather rounds,
  each sending nbytes / N)."""
  n = int(members)
  if n <= 1:
    return 0.0
  return 2.0 * (n - 1) * latency_s + 2.0 * (n - 1) / n * nbytes / bandwidth


def send_s(nbytes: float, latency_s: float, bandwidth: float) -> float:
  """Seconds of one transfer of `nbytes` over a link: latency + bytes / bandwidth."""
  return latency_s + nbytes / bandwidth


def stage_seconds(layers, layer_compute_s, layer_allreduce_s, edge_s=0.0):
  """(f, b): forward and backward seconds of one microbatch on a stage of `layers` layers.

  A layer's forward is its compute (`layer_compute_s`: the slowest tensor device's share) and
  two tensor all-reduces (`layer_allreduce_s` each: after attention and after the MLP). The
  backward recomputes the forward (compute + 2 all-reduces) and then runs twice its work
  (2 x compute + 2 all-reduces). `edge_s`: the stage's unsplit forward work outside the blocks
  (the embedding on the first stage, the head on the last), recomputed and differentiated the
  same way: f = layers (c + 2 a) + e, b = layers (3 c + 4 a) + 3 e. Arrays broadcast.
  """
  layers = np.asarray(layers, np.float64)
  c, a = np.asarray(layer_compute_s, np.float64), np.asarray(layer_allreduce_s, np.float64)
  e = np.asarray(edge_s, np.float64)
  return layers * (c + 2.0 * a) + e, layers * (3.0 * c + 4.0 * a) + 3.0 * e
