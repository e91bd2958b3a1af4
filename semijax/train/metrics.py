"""Metric logging: scalars to a JSONL file and TensorBoard event files, plus a progress line.

`MetricWriter` writes, for every `write(step, scalars)` call,
  * one JSON object `{"step": step, **scalars}` per line to `workdir/metrics.jsonl`;
  * the same scalars to TensorBoard event files under `workdir/tensorboard` (with tensorboardX,
    which needs no TensorFlow).
Only process 0 writes by default; on every other process the writer is a no-op that creates
nothing on disk.

A run resumed from a checkpoint at step k passes `resume_step=k`: the JSONL lines of steps > k
(which the run will redo) are dropped, and TensorBoard is told to purge its events of steps > k.

`read_jsonl` and `read_tensorboard` read both back (the latter parses the TFRecord framing itself,
so it needs no TensorFlow either). `Progress` formats a one-line report with throughput and ETA;
`say` prints a console line for the user.
"""

from __future__ import annotations

import collections
import datetime
import json
import os
import secrets
import stat
import struct
import time
from typing import Any, Iterator, Mapping

import jax

JSONL_NAME = "metrics.jsonl"
CONFIG_NAME = "config.json"
TENSORBOARD_DIR = "tensorboard"
EVENT_FILE_MARKER = "events.out.tfevents."


def say(message: str) -> None:
  """A console line for the user (process 0 only): progress, decisions, results."""
  if jax.process_index() == 0:
    print(message, flush=True)


# --- writing ------------------------------------------------------------------------------------


class MetricWriter:
  """Scalars to workdir/metrics.jsonl and TensorBoard event files; only process 0 writes."""

  def __init__(self, workdir: str, *, enabled: bool | None = None,
               resume_step: int | None = None):
    """Opens the outputs (creating `workdir` if needed) unless disabled.

    Args:
      workdir: the directory that gets metrics.jsonl, config.json and tensorboard/.
      enabled: whether this writer writes; defaults to `jax.process_index() == 0`. A disabled
        writer creates nothing on disk and all its methods are no-ops.
      resume_step: the checkpoint step a resumed run restarts from. Existing JSONL lines with
        step > resume_step are dropped and TensorBoard purges its events of those steps.
    """
    self.workdir = workdir
    self.enabled = jax.process_index() == 0 if enabled is None else bool(enabled)
    self.jsonl_path = os.path.join(workdir, JSONL_NAME)
    self.config_path = os.path.join(workdir, CONFIG_NAME)
    self.tensorboard_dir = os.path.join(workdir, TENSORBOARD_DIR)
    self._first_step = 0 if resume_step is None else int(resume_step)
    self._jsonl = None
    self._tb = None
    if not self.enabled:
      return
    os.makedirs(workdir, exist_ok=True)
    if resume_step is not None and os.path.exists(self.jsonl_path):
      _truncate_jsonl(self.jsonl_path, int(resume_step))
    self._jsonl = _open_for_append(self.jsonl_path)
    self._tb = _summary_writer(self.tensorboard_dir, resume_step)

  def write(self, step: int, scalars: Mapping[str, Any]) -> None:
    """Writes `scalars` (tag -> number, e.g. "train/loss") at `step` to JSONL and TensorBoard."""
    if not self.enabled:
      return
    if "step" in scalars:
      raise ValueError("scalars must not contain the key 'step'; it is the record's step")
    step = int(step)
    values = {tag: float(value) for tag, value in scalars.items()}
    self._jsonl.write(json.dumps({"step": step, **values}) + "\n")
    self._jsonl.flush()
    for tag, value in values.items():
      self._tb.add_scalar(tag, value, step)
    self._tb.flush()

  def write_config(self, config: Any) -> str:
    """Writes `config` (a ConfigDict or a dict) to workdir/config.json and returns that path."""
    if not self.enabled:
      return self.config_path
    text = config_to_json(config)
    _atomic_write(self.config_path, text + "\n")
    # Indented lines are a Markdown code block, so TensorBoard's text tab shows the JSON verbatim.
    markdown = "\n".join("    " + line for line in text.splitlines())
    self._tb.add_text("config", markdown, self._first_step)
    self._tb.flush()
    return self.config_path

  def close(self) -> None:
    """Flushes and closes the outputs; a second call does nothing."""
    if self._jsonl is not None:
      self._jsonl.close()
      self._jsonl = None
    if self._tb is not None:
      self._tb.close()
      self._tb = None

  def __enter__(self) -> "MetricWriter":
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def config_to_json(config: Any) -> str:
  """`config` as indented, key-sorted JSON; tuples become lists, unknown objects their str."""
  as_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
  return json.dumps(as_dict, indent=2, sort_keys=True, default=str)


def _summary_writer(logdir: str, resume_step: int | None):
  """A tensorboardX writer whose event file name sorts after any earlier one in `logdir`."""
  import tensorboardX  # pylint: disable=g-import-not-at-top  (only process 0 needs it)
  # tensorboardX names files by the second and opens them with "wb": a second writer within the
  # same second would overwrite the first file. A nanosecond suffix keeps names unique and sorted.
  return tensorboardX.SummaryWriter(
      logdir=logdir, filename_suffix=f".{time.time_ns()}",
      purge_step=None if resume_step is None else int(resume_step) + 1)


def _open_for_append(path: str):
  """Opens `path` for appending, first ending an unterminated last line (left by a crash)."""
  if os.path.exists(path) and os.path.getsize(path) > 0:
    with open(path, "rb") as f:
      f.seek(-1, os.SEEK_END)
      unterminated = f.read(1) != b"\n"
    if unterminated:
      with open(path, "a", encoding="utf-8") as f:
        f.write("\n")
  return open(path, "a", encoding="utf-8")


def _truncate_jsonl(path: str, resume_step: int) -> None:
  """Rewrites `path` atomically, keeping only the records with step <= `resume_step`."""
  kept = []
  with open(path, encoding="utf-8") as f:
    for line in f:
      step = _step_of(_parse_line(line))
      if step is not None and step <= resume_step:
        kept.append(line.rstrip("\n") + "\n")
  _atomic_write(path, "".join(kept))


def _parse_line(line: str) -> dict | None:
  """The JSON object on `line`, or None for a blank, truncated or non-object line."""
  try:
    record = json.loads(line)
  except json.JSONDecodeError:
    return None
  return record if isinstance(record, dict) else None


def _step_of(record: dict | None) -> float | None:
  """The numeric "step" of a record, or None."""
  step = None if record is None else record.get("step")
  return step if isinstance(step, (int, float)) and not isinstance(step, bool) else None


def _atomic_write(path: str, text: str) -> None:
  """Writes `text` to a temporary file next to `path`, then renames it over `path`.

  The file gets the mode a plain `open(path, "w")` would give it: an existing file's own mode,
  else 0o666 less the umask (tempfile.mkstemp would leave 0o600, unreadable to a team).
  """
  try:
    mode = stat.S_IMODE(os.stat(path).st_mode)
  except FileNotFoundError:
    mode = None
  tmp = os.path.join(os.path.dirname(path) or ".", f".tmp-{secrets.token_hex(8)}")
  # A new file (O_EXCL), which the kernel gives 0o666 less the umask, as open() would.
  fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
  try:
    with os.fdopen(fd, "w", encoding="utf-8") as f:
      if mode is not None:
        os.fchmod(f.fileno(), mode)
      f.write(text)
      f.flush()
      os.fsync(f.fileno())
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


# --- reading ------------------------------------------------------------------------------------


def read_jsonl(path: str) -> list[dict]:
  """The records of a JSONL file; an unterminated, unparsable last line (a crash) is skipped."""
  with open(path, encoding="utf-8") as f:
    lines = f.readlines()
  records = []
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    if i == len(lines) - 1 and not line.endswith("\n") and _parse_line(line) is None:
      break
    records.append(json.loads(line))
  return records


def read_tensorboard(logdir: str) -> dict[str, list[tuple[int, float]]]:
  """The scalar (simple_value) summaries of every event file under `logdir`, without TensorFlow.

  Files are read directory by directory in name (= creation) order. As in TensorBoard, a
  SessionLog START event at step s (written by a writer with purge_step=s) drops the values of
  steps >= s read before it from the same directory.

  Returns:
    {tag: [(step, value), ...]} with each list sorted by step (stable for repeated steps).
  """
  if not os.path.isdir(logdir):
    raise FileNotFoundError(f"no such directory: {logdir}")
  merged = collections.defaultdict(list)
  for _, paths in sorted(_event_files_by_dir(logdir).items()):
    for tag, points in _read_run(sorted(paths)).items():
      merged[tag].extend(points)
  return {tag: sorted(points, key=lambda p: p[0]) for tag, points in sorted(merged.items())}


def _event_files_by_dir(logdir: str) -> dict[str, list[str]]:
  out = {}
  for dirpath, _, filenames in os.walk(logdir):
    paths = [os.path.join(dirpath, n) for n in filenames if n.startswith(EVENT_FILE_MARKER)]
    if paths:
      out[dirpath] = paths
  return out


def _read_run(paths: list[str]) -> dict[str, list[tuple[int, float]]]:
  """The scalars of one run (the event files of one directory, in order), purges applied."""
  from tensorboardX.proto import event_pb2  # pylint: disable=g-import-not-at-top
  start = event_pb2.SessionLog.START
  points = collections.defaultdict(list)
  for path in paths:
    for data in _tfrecords(path):
      event = event_pb2.Event.FromString(data)
      if event.HasField("session_log") and event.session_log.status == start:
        for tag in points:
          points[tag] = [p for p in points[tag] if p[0] < event.step]
      if event.HasField("summary"):
        for value in event.summary.value:
          if value.HasField("simple_value"):
            points[value.tag].append((int(event.step), float(value.simple_value)))
  return {tag: p for tag, p in points.items() if p}


def _tfrecords(path: str) -> Iterator[bytes]:
  """The records of a TFRecord file (CRCs not checked); stops at a truncated last record."""
  with open(path, "rb") as f:
    while True:
      header = f.read(12)                       # uint64 length, uint32 masked crc of length
      if len(header) < 12:
        return
      (length,) = struct.unpack("<Q", header[:8])
      data = f.read(length)
      footer = f.read(4)                        # uint32 masked crc of data
      if len(data) < length or len(footer) < 4:
        return
      yield data


# --- progress -----------------------------------------------------------------------------------


class Progress:
  """A one-line progress report with throughput."""

  def __init__(self, total_steps: int, *, unit: str = "tokens", start_step: int = 0):
    """Starts a report with no step times seen.

    Args:
      total_steps: the last step of the run.
      unit: what `items_per_step` counts, e.g. "tokens" or "examples".
      start_step: the step this run starts (or resumes) from, for `steps_this_run`.
    """
    self.total_steps = int(total_steps)
    self.unit = unit
    self.start_step = int(start_step)
    self._step_times: list[float] = []

  def steps_this_run(self, step: int) -> int:
    """How many steps this run has done by `step` (excluding those of a resumed checkpoint)."""
    return int(step) - self.start_step

  def mean_step_time(self) -> float:
    """The mean step time seen so far, without the first (compile) step once there are more."""
    times = self._step_times[1:] if len(self._step_times) > 1 else self._step_times
    return sum(times) / len(times) if times else 0.0

  def line(self, step: int, step_time_s: float, items_per_step: float,
           scalars: Mapping[str, Any], batches: float | None = None) -> str:
    """E.g. "step  40/200 | loss 2.3141 | 0.084 s/step | 12,190 tokens/s | eta 0:00:13"; with
    `batches`, the global batches trained by `step` when steps are updates of unequal size
    (a replica mode's), "update 93 | 40.5/200 batches | loss 2.3141 | 0.042 s/update | ..."."""
    self._step_times.append(float(step_time_s))
    if batches is None:
      width = len(str(self.total_steps))
      parts, per = [f"step {int(step):>{width}}/{self.total_steps}"], "step"
      remaining = max(self.total_steps - int(step), 0)
    else:
      parts, per = [f"update {int(step)}", f"{batches:.1f}/{self.total_steps} batches"], "update"
      remaining = max(self.total_steps - batches, 0) * int(step) / max(batches, 1e-9)
    parts += [f"{name} {float(v):.4f}" for name, v in _short_names(scalars).items()]
    parts.append(f"{step_time_s:.3f} s/{per}")
    parts.append(f"{_rate(items_per_step, step_time_s)} {self.unit}/s")
    parts.append(f"eta {_duration(remaining * self.mean_step_time())}")
    return " | ".join(parts)


def _short_names(scalars: Mapping[str, Any]) -> dict[str, Any]:
  """"train/loss" -> "loss", keeping the full tag where two short names would collide."""
  short = [tag.rsplit("/", 1)[-1] for tag in scalars]
  counts = collections.Counter(short)
  return {(s if counts[s] == 1 else tag): v for s, (tag, v) in zip(short, scalars.items())}


def _rate(items_per_step: float, step_time_s: float) -> str:
  if step_time_s <= 0:
    return "-"
  return f"{items_per_step / step_time_s:,.0f}"


def _duration(seconds: float) -> str:
  return str(datetime.timedelta(seconds=round(max(seconds, 0.0))))
