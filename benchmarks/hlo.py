"""What a compiled program's optimized HLO text holds: its all-reduces and their groups."""

from __future__ import annotations

import re


def all_reduce_group_sizes(hlo: str) -> list[int]:
  """The replica-group size of every all-reduce in compiled HLO text (explicit `{{0,1},{2,3}}`
  or iota `[groups,size]<=[...]` groups; `{}`, all devices, reads as -1)."""
  sizes = []
  for line in hlo.splitlines():
    if not re.search(r"\ball-reduce(-start)?\(", line):
      continue
    iota = re.search(r"replica_groups=\[\d+,(\d+)\]<=", line)
    explicit = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
    if iota:
      sizes.append(int(iota.group(1)))
    elif explicit:
      sizes.append(len(explicit.group(1).split(",")))
    elif "replica_groups={}" in line:
      sizes.append(-1)
    else:
      raise ValueError(f"an all-reduce without replica groups this reads: {line.strip()[:200]}")
  return sizes


def all_reduces(hlo: str) -> dict:
  """{"all_reduces": how many, "over_one_device": how many of them have groups of one device}
  in compiled HLO text."""
  sizes = all_reduce_group_sizes(hlo)
  return {"all_reduces": len(sizes), "over_one_device": sum(s == 1 for s in sizes)}
