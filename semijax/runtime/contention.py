"""Real CPU contention for benchmarks: one busy process pinned to a core, on a schedule.

  with contention.Injector(core=1, pattern="bursts", on_s=20, off_s=20) as inj:
    run_benchmark()          # whatever runs on core 1 now shares it half of the time
  record["contention"] = inj.to_json()

Patterns:
  steady  the competitor runs the whole time;
  bursts  on for on_s, off for off_s, repeating;
  random  on/off phases of exponentially distributed lengths (means on_s, off_s) from `seed`;
  none    nothing runs (a baseline with the same code path).

The competitor is one pure-Python busy loop (no jax import, so it starts in milliseconds), pinned
to `core` and killed by the kernel if the thread that started it dies (PR_SET_PDEATHSIG). A
daemon thread pauses and resumes it with SIGSTOP / SIGCONT at the phase boundaries and records
when it actually did so: `intervals()` are the measured on-periods, `is_on(t)` the planned ones.
"""

from __future__ import annotations

import bisect
import os
import random
import signal
import subprocess
import sys
import threading
import time

from semijax.runtime import launch

PATTERNS = ("steady", "bursts", "random", "none")
_BUSY_LOOP = "while True: pass"
_JOIN_S = 5.0   # the longest stop() waits for the thread, and for the child after SIGKILL


class _Schedule:
  """Planned on/off phases: the times (s from start) at which the competitor toggles."""

  def __init__(self, pattern: str, on_s: float, off_s: float, seed: int, start_on: bool):
    self.pattern, self.start_on = pattern, start_on
    self._means = (on_s, off_s) if start_on else (off_s, on_s)   # phase k has _means[k % 2]
    self._rng = random.Random(seed)
    self._toggles: list[float] = []
    self._lock = threading.Lock()

  def toggle(self, k: int) -> float:
    """The time of the k-th toggle (k = 0, 1, ...); phases toggle forever."""
    with self._lock:
      while len(self._toggles) <= k:
        n = len(self._toggles)
        mean = self._means[n % 2]
        length = mean if self.pattern == "bursts" else self._rng.expovariate(1 / mean)
        self._toggles.append((self._toggles[-1] if self._toggles else 0.0) + length)
      return self._toggles[k]

  def is_on(self, t: float) -> bool:
    if t < 0 or self.pattern == "none":
      return False
    if self.pattern == "steady":
      return True
    k = 0
    while self.toggle(k) <= t:   # extends the plan up to t
      k += 1
    return self.start_on != (k % 2 == 1)


class Injector:
  """One CPU-bound competitor process on `core`, following `pattern` (see the module doc).

  Start it from a thread that outlives it (normally the main thread): the kernel kills the
  competitor when that thread exits.
  """

  def __init__(self, core: int, pattern: str = "steady", *, on_s: float = 20, off_s: float = 20,
               seed: int = 0, start_on: bool = True):
    if pattern not in PATTERNS:
      raise ValueError(f"pattern: {pattern!r} is not one of {PATTERNS}")
    available = launch.machine_cores()
    if not isinstance(core, int) or core not in available:
      raise ValueError(f"core: {core!r} is not among this machine's cores {sorted(available)}")
    for name, value in (("on_s", on_s), ("off_s", off_s)):
      if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}: need a positive number of seconds, got {value!r}")
    if not isinstance(seed, int):
      raise ValueError(f"seed: need an int, got {seed!r}")
    self.core, self.pattern = core, pattern
    self.on_s, self.off_s, self.seed, self.start_on = float(on_s), float(off_s), seed, start_on
    self._schedule = _Schedule(pattern, self.on_s, self.off_s, seed, start_on)
    self._proc: subprocess.Popen | None = None
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._on: list[list[float]] = []   # measured on-periods [start, end]; end None while on
    self._t0: float | None = None
    self._t_stop: float | None = None

  @property
  def pid(self) -> int | None:
    """The competitor's pid (None before start, and for pattern "none")."""
    return self._proc.pid if self._proc else None

  def _elapsed(self) -> float:
    return time.monotonic() - self._t0

  def start(self) -> "Injector":
    if self._t0 is not None:
      raise RuntimeError("Injector.start: already started (make a new Injector)")
    self._t0 = time.monotonic()
    if self.pattern == "none":
      return self
    self._proc = launch.spawn(
        [sys.executable, "-S", "-c", _BUSY_LOOP], [self.core], stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    self._t0 = time.monotonic()
    if self.start_on:
      self._on.append([0.0, None])
    else:
      self._signal(signal.SIGSTOP)
    if self.pattern != "steady":
      self._thread = threading.Thread(target=self._follow_schedule, daemon=True,
                                      name=f"contention-core{self.core}")
      self._thread.start()
    return self

  def _signal(self, sig: int) -> None:
    try:
      self._proc.send_signal(sig)
    except ProcessLookupError:
      pass   # died (or was killed) already; stop() reaps it

  def _follow_schedule(self) -> None:
    on, k = self.start_on, 0
    while not self._stop.wait(max(0.0, self._schedule.toggle(k) - self._elapsed())):
      on, k = not on, k + 1
      with self._lock:
        if self._stop.is_set():
          return
        self._signal(signal.SIGCONT if on else signal.SIGSTOP)
        t = self._elapsed()
        if on:
          self._on.append([t, None])
        else:
          self._on[-1][1] = t

  def stop(self) -> None:
    """Stops the schedule and kills the competitor (idempotent; returns within ~10 s)."""
    if self._t0 is None or self._t_stop is not None:
      return
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=_JOIN_S)
    with self._lock:
      self._t_stop = self._elapsed()
      if self._on and self._on[-1][1] is None:
        self._on[-1][1] = self._t_stop
      if self._proc is not None:
        self._proc.kill()   # SIGKILL also ends a stopped process
        try:
          self._proc.wait(timeout=_JOIN_S)
        except subprocess.TimeoutExpired:
          raise RuntimeError(f"contention: competitor pid {self._proc.pid} survived SIGKILL")

  def __enter__(self) -> "Injector":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()

  def intervals(self) -> list[tuple[float, float]]:
    """Measured on-periods, seconds from start(); one still on is closed now (or at stop)."""
    with self._lock:
      now = self._t_stop if self._t_stop is not None else (
          self._elapsed() if self._t0 is not None else 0.0)
      return [(a, now if b is None else b) for a, b in self._on]

  def is_on(self, t: float) -> bool:
    """Whether the schedule has the competitor on at `t` seconds from start()."""
    return self._schedule.is_on(t)

  def to_json(self) -> dict:
    """A JSON-able description: the pattern, its parameters and the measured on-periods."""
    return {"core": self.core, "pattern": self.pattern, "on_s": self.on_s, "off_s": self.off_s,
            "seed": self.seed, "start_on": self.start_on,
            "intervals": [list(i) for i in self.intervals()]}
