"""Timing cells in interleaved rounds: the order of each round, and medians with their spread.

A benchmark compares cells (programs, policies, settings) measured on one noisy machine. Each
round runs every cell once, in an order that changes from round to round (`round_orders`), so
that a slow spell of the machine falls on different cells; a figure is the median over rounds
with its min and max (`stats`), and a ratio of two cells is taken per round, where both saw the
same machine, before its median (`ratio_stats`). `interleave` runs the rounds and hands the
figures so far to a callback after each, so a benchmark cut off by a time limit still leaves the
rounds it finished.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np


def round_orders(policies, rounds: int) -> list[list[str]]:
  """The order of `policies` in each of `rounds` rounds: rows of a Williams design, spaced by
  about len / rounds (at least one), so that every policy runs early in one round and late in
  another, and follows a different policy in each round (a run that leaves the machine slower
  or faster, say by its garbage or its competitor's timing, then does not always hit the same
  next policy). Row r runs policy (first[k] + r) mod n at place k, first = 0, 1, n-1, 2, n-2..."""
  policies = list(policies)
  n = max(len(policies), 1)
  first = [0]
  for k in range(1, n):
    first.append((k + 1) // 2 if k % 2 else n - k // 2)
  shifts = [(r % n if rounds >= n else (r * n) // rounds) for r in range(rounds)]
  if not policies:
    return [[] for _ in shifts]
  return [[policies[(f + s) % n] for f in first] for s in shifts]


def interleave(cells: Mapping[str, Callable[[], float]], rounds: int,
               after_round: Callable[[dict[str, list[float]]], None] | None = None
               ) -> dict[str, list[float]]:
  """{cell: [its figure in each round]}: `rounds` rounds, each calling every cell's measure
  once in `round_orders`' order; `after_round` gets the figures of the rounds done so far."""
  figures = {name: [] for name in cells}
  for order in round_orders(list(cells), rounds):
    for name in order:
      figures[name].append(float(cells[name]()))
    if after_round is not None:
      after_round(figures)
  return figures


def stats(values: Sequence[float]) -> dict:
  """{"median", "min", "max", "rounds"} of one cell's figures over rounds."""
  v = np.asarray(values, dtype=float)
  return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max()),
          "rounds": int(v.size)}


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict:
  """`stats` of num / den taken round by round (the rounds both cells finished)."""
  n = min(len(num), len(den))
  return stats([a / b for a, b in zip(num[:n], den[:n])])


def cell(s: dict, spec: str = ".3g") -> str:
  """A table cell "median (min-max)" of a `stats` dict."""
  return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"
