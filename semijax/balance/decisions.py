"""The decision log: one JSON line per controller decision, in workdir/decisions.jsonl."""

from __future__ import annotations

import json
import os


class DecisionLog:
  """Appends decisions to `directory`/decisions.jsonl (a no-op without a directory).

  A record is written once the steps after its decision were measured (the loop logs a decision
  with the time measured after it); records of changes are flushed at once.
  """

  NAME = "decisions.jsonl"

  def __init__(self, directory: str | None):
    self._file = None
    if directory is not None:
      os.makedirs(directory, exist_ok=True)
      self._file = open(os.path.join(directory, self.NAME), "a", encoding="utf-8")

  def write(self, record: dict, flush: bool = False) -> None:
    if self._file is None:
      return
    self._file.write(json.dumps(record) + "\n")
    if flush:
      self._file.flush()

  @property
  def closed(self) -> bool:
    return self._file is None

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None


def read(directory: str) -> list[dict]:
  """The decisions logged in `directory` (empty if none)."""
  path = os.path.join(directory, DecisionLog.NAME)
  if not os.path.exists(path):
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]
