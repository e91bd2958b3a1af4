"""How much of this host's CPU the hypervisor took: the "steal" time of Linux's /proc/stat.

On a virtual machine whose host is oversubscribed, the hypervisor runs other guests on our
cores; the kernel counts that time as steal. A benchmark that compares policies by wall time
then measures the host more than the policies: at 30% steal, varying from one minute to the
next, two runs of one configuration differ by far more than the policies do. So benchmarks
record the steal share of every run, and say when it was too high for their ratios to carry a
claim.

  meter = hostcpu.StealMeter()           # reads /proc/stat now
  run()
  record["host_steal"] = meter.share()   # steal / all CPU time since, or None (not Linux)

The shares are of the whole machine (every core), as the kernel counts them.
"""

from __future__ import annotations

PROC_STAT = "/proc/stat"
# The columns of the aggregate "cpu" line of /proc/stat, in order (proc(5)); guest time is
# already counted in user and nice, so it is left out of the total.
FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
# Above this share of stolen CPU time, a benchmark's ratios measure the host (see the module
# doc): runs of one configuration on this 2-core machine spread by 5-8% at no steal, and steal
# that comes and goes moves whole runs.
STEAL_WARN = 0.05


def parse(text: str) -> dict[str, int] | None:
  """{field: clock ticks since boot} of the aggregate "cpu" line of /proc/stat `text` (fields
  the kernel does not report count 0), or None if there is no such line."""
  for line in text.splitlines():
    parts = line.split()
    if parts and parts[0] == "cpu":
      values = [int(v) for v in parts[1:1 + len(FIELDS)]]
      values += [0] * (len(FIELDS) - len(values))
      return dict(zip(FIELDS, values))
  return None


def read(path: str = PROC_STAT) -> dict[str, int] | None:
  """The host's CPU ticks by kind (`parse`), or None where `path` cannot be read (not Linux)."""
  try:
    with open(path) as f:
      return parse(f.read())
  except (OSError, ValueError):
    return None


def steal_share(before: dict[str, int] | None, after: dict[str, int] | None) -> float | None:
  """Stolen ticks over all ticks between two readings; None if either is missing or no tick
  passed."""
  if before is None or after is None:
    return None
  total = sum(after[k] - before[k] for k in FIELDS)
  if total <= 0:
    return None
  return (after["steal"] - before["steal"]) / total


def describe(steal: float | None, what: str = "the runs") -> str:
  """A sentence for a results table: the steal share during `what`, with a warning above
  `STEAL_WARN`; "" where there is no figure (not Linux)."""
  if steal is None:
    return ""
  text = f"The hypervisor took {steal:.0%} of this host's CPU time during {what}."
  alarm = warning(steal)
  return f"{text} {alarm}" if alarm else text


def warning(steal: float | None) -> str:
  """What a steal share above `STEAL_WARN` means for a benchmark's ratios; "" at or below."""
  if steal is None or steal <= STEAL_WARN:
    return ""
  return (f"Above {STEAL_WARN:.0%}, the ratios measure the host as much as the code; rerun on a "
          f"quiet host before drawing conclusions.")


class StealMeter:
  """The steal share of the host's CPU time from construction to `share()`."""

  def __init__(self, path: str = PROC_STAT):
    self.path = path
    self._start = read(path)

  def share(self) -> float | None:
    return steal_share(self._start, read(self.path))
