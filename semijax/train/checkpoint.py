"""Orbax checkpoints of the *logical* train state, with the layout stored beside it.

A checkpoint holds layout-independent parameters and optimizer state (every unit axis in logical
order; zeros appended up to a multiple of the tensor devices when they do not divide the units),
saved sharded as the devices hold them (`Engine.to_logical`), so it restores onto any layout,
capacity bucket or tensor device count: the engine moves it into the new padded layout. Beside
it, a JSON item records the step, the data position, the layout it was trained with and the
model config (a checkpoint is never restored into a different model).

Every checkpoint is verified before it is read: once a save is committed, the size and SHA-256
of every file in the step's folder (arrays, metadata, Orbax's own) are recorded in
`<step>/semijax_checksums.json`; `verify` checks them. Both split the files over the processes
(each reads its share once, whatever the cluster's size, and `barrier.gather` shares the
results). `latest_intact_step` is the newest checkpoint that passes (one without the record,
cut short while saving, does not). A damaged checkpoint is never deleted: a run that resumes
from an older one sets it aside (`<directory>.damaged/<step>`) so that its own saves do not meet
it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from semijax.core import barrier
from semijax.core import engine as engine_lib
from semijax.errors import ConfigError


def param_dtypes(params) -> list[str]:
  """The dtypes a parameter tree is stored in, sorted (what a checkpoint's meta records)."""
  return sorted({str(x.dtype) for x in jax.tree.leaves(params)})


def dtype_change(meta: dict, abstract: engine_lib.TrainState) -> str:
  """"" when `abstract`'s parameters have the dtypes the checkpoint stored (or it did not record
  them), else a clause for the resume line: restoring casts every value to the new dtype."""
  saved, now = meta.get("param_dtypes"), param_dtypes(abstract.params)
  return "" if saved in (None, now) else f"; parameters stored in {'/'.join(saved)}, " \
      f"restored into {'/'.join(now)}"


def check_sync_mode(meta: dict, mode: str, step: int, directory: str) -> None:
  """Raises ConfigError when the checkpoint was saved by a run in another `config.sync.mode`
  (a checkpoint without one was saved by a "sync" run): its in-flight state (pending
  gradients, replicas, momentum) would be lost or missing."""
  saved = meta.get("sync_mode", "sync")
  if saved != mode:
    raise ConfigError(
        f"config.sync.mode: the checkpoint at step {step} in {directory} was saved by a "
        f"{saved!r} run, this one is {mode!r} (its in-flight state would be lost); use "
        "another --workdir")


def check_stages(meta: dict, mode: str, pipe: int | None, step: int, directory: str) -> None:
  """Raises ConfigError when a replica sync mode's checkpoint was saved on another number of
  pipeline stages (`pipe`; None: unpipelined) than this run has: its in-flight state (pending
  gradients, replicas) is kept per stage. A "sync" checkpoint restores onto any."""
  saved = meta.get("pipe")
  if mode != "sync" and saved != pipe:
    on = lambda p: "unpipelined" if p is None else f"on {p} stages"
    raise ConfigError(
        f"config.mesh.pipe: the checkpoint at step {step} in {directory} was saved {on(saved)} "
        f"with sync mode {mode!r}, this run is {on(pipe)}; its in-flight state restores onto "
        "as many stages only (use another --workdir)")


def unit_counts(meta: dict, kind: str) -> tuple[int, ...]:
  """Units of `kind` each device held in an unpipelined checkpoint's layout (its meta)."""
  return tuple(len(o) for o in meta["layout"][kind]["owned"])


def check_loss_scale(meta: dict, setting: str, step: int, directory: str) -> None:
  """Raises ConfigError when the checkpoint was saved under another resolved
  `config.optimizer.loss_scale` ("none" where it records none): the optimizer state holds the
  scale under "dynamic" only, so the two states do not match."""
  saved = meta.get("loss_scale", "none")
  if saved != setting:
    raise ConfigError(
        f"config.optimizer.loss_scale: the checkpoint at step {step} in {directory} was saved "
        f"with loss scaling {saved!r}, this run has {setting!r} (under 'auto', model.dtype "
        "float16 scales and the others do not); set optimizer.loss_scale to match or use "
        "another --workdir")


CHECKSUMS = "semijax_checksums.json"
# A leaf of a restore's abstract tree that is not read (it comes back as itself): another
# process's part of the state.
SKIP = ocp.PLACEHOLDER


def _digest(path: str) -> str:
  with open(path, "rb") as f:
    return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: str) -> list[str]:
  """Every file under `folder` but the checksum record, as sorted relative paths."""
  out = []
  for root, _, names in os.walk(folder):
    out += [os.path.relpath(os.path.join(root, n), folder) for n in names]
  return sorted(f for f in out if f != CHECKSUMS)


def _mine(count: int, collective: bool = True) -> range:
  """The indices of this process's share of `count` sorted files: every process_count-th, from
  its index (all of them when not `collective`)."""
  return range(jax.process_index(), count, jax.process_count()) if collective else range(count)


def record_checksums(folder: str) -> None:
  """Writes `folder`/semijax_checksums.json: {"files": {path: [bytes, sha256]}} (atomically).
  Every process calls it: each hashes its share of the files (`_mine`), process 0 writes the
  record once it has all, and every process returns once it is written."""
  names = _files(folder)
  share = lambda names: {f: [os.path.getsize(os.path.join(folder, f)),
                             _digest(os.path.join(folder, f))] for f in names}
  parts = barrier.gather(f"checksums of {folder}", share([names[i] for i in _mine(len(names))]))
  if jax.process_index() == 0:
    files = share(names) if parts is None else {k: v for part in parts for k, v in part.items()}
    tmp = os.path.join(folder, CHECKSUMS + ".tmp")
    with open(tmp, "w") as f:
      json.dump({"files": files}, f, indent=0, sort_keys=True)
    os.replace(tmp, os.path.join(folder, CHECKSUMS))
  barrier.wait_for_all(f"checksums of {folder} written")


_INTACT: dict[str, tuple] = {}   # folder -> the stat of its files when it last verified


def _stat_key(folder: str, names) -> tuple:
  """(name, size, mtime) of `names` and the checksum record in `folder`: a folder whose key is
  unchanged since it verified need not be read again (the run's start verifies each once)."""
  def one(name):
    st = os.stat(os.path.join(folder, name))
    return name, st.st_size, st.st_mtime_ns
  return tuple(one(n) for n in sorted(names) + [CHECKSUMS])


def check_files(folder: str, collective: bool = True) -> str | None:
  """None if every file recorded in `folder`'s checksums is there with its size and digest;
  else what is wrong, in a few words naming the first bad file. `collective`: every process
  calls it and checks its share of the files (`_mine`), and all get the same answer; else this
  process checks every file."""
  try:
    with open(os.path.join(folder, CHECKSUMS)) as f:
      files = json.load(f)["files"]
    names = sorted(files)
  except FileNotFoundError:
    return "it has no checksum record (saving it was cut short)"
  except (OSError, ValueError, KeyError, TypeError):
    return f"its checksum record {CHECKSUMS} is unreadable"
  try:
    cached = _INTACT.get(folder) == _stat_key(folder, names)
  except (OSError, TypeError):
    cached = False                        # a file is gone: checking says which
  found = None if cached else next(   # this share's first problem: (its index, the words)
      ((i, p) for i in _mine(len(names), collective)
       if (p := _file_problem(folder, names[i], files[names[i]])) is not None), None)
  mine = [] if found is None else [found]
  parts = barrier.gather(f"check of {folder}", mine) if collective else [mine]
  if parts is None:                       # no coordination service: check them all here
    return check_files(folder, collective=False)
  first = min((tuple(p) for part in parts for p in part), default=None)
  if first is None:
    _INTACT[folder] = _stat_key(folder, names)
    return None
  return first[1]


def _file_problem(folder: str, name: str, recorded) -> str | None:
  """What is wrong with file `name` against its recorded [bytes, sha256], or None."""
  size, digest = recorded
  path = os.path.join(folder, name)
  if not os.path.isfile(path):
    return f"{name} is missing"
  if (actual := os.path.getsize(path)) != size:
    return f"{name} has {actual} bytes, {size} were written"
  if _digest(path) != digest:
    return f"{name} does not match its checksum"
  return None


class Checkpointer:
  """Saves and restores logical train states under `directory` (one sub-folder per step), each
  verified by its checksums (see module doc)."""

  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, logical: engine_lib.TrainState, meta: dict,
           extra: dict | None = None, snapshot=None) -> None:
    """Saves and waits until the checkpoint is committed (so a crash later cannot lose it).

    Args:
      step: the step (the sub-folder's name).
      logical: the sharded logical train state (each process writes its devices' shards).
      meta: JSON-able facts (data position, layout, model).
      extra: optional host state (a tree of numpy arrays, e.g. resize priority scores).
      snapshot: optional sharded logical parameter-shaped tree (the priority's snapshot).
    """
    items = dict(state=ocp.args.StandardSave(logical),
                 meta=ocp.args.JsonSave(dict(meta, step=step, has_extra=extra is not None,
                                             has_snapshot=snapshot is not None,
                                             param_dtypes=param_dtypes(logical.params))))
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(extra)
    if snapshot is not None:
      items["snapshot"] = ocp.args.StandardSave(snapshot)
    self._manager.save(step, args=ocp.args.Composite(**items))
    self._manager.wait_until_finished()
    barrier.wait_for_all(f"saved checkpoint {step}")     # committed: every file is there
    record_checksums(self.folder(step))

  def folder(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def verify(self, step: int, collective: bool = True) -> str | None:
    """None if checkpoint `step` is intact, else what is wrong with it (`check_files`; every
    process calls it, unless not `collective`)."""
    return check_files(self.folder(step), collective)

  def set_aside(self, step: int) -> str:
    """Moves damaged checkpoint `step` out of the way of new saves, to
    <directory>.damaged/<step> (process 0; every process waits for it); returns where."""
    parent = self.directory + ".damaged"
    target, n = os.path.join(parent, str(step)), 1
    while os.path.exists(target):
      target, n = os.path.join(parent, f"{step}.{n}"), n + 1
    if jax.process_index() == 0:
      os.makedirs(parent, exist_ok=True)
      os.rename(self.folder(step), target)
    barrier.wait_for_all(f"set aside checkpoint {step}")
    self._manager.reload()
    # before process 0 moves the next one, which reload would read
    barrier.wait_for_all(f"reloaded without checkpoint {step}")
    return target

  def latest_intact_step(self, on_damaged: Callable[[int, str], None] | None = None,
                         collective: bool = True) -> int | None:
    """The newest checkpoint that verifies, or None; `on_damaged(step, problem)` hears of each
    newer one that does not. `collective`: every process calls it (see `check_files`)."""
    for step in reversed(self.all_steps()):
      problem = self.verify(step, collective)
      if problem is None:
        return step
      if on_damaged is not None:
        on_damaged(step, problem)
    return None

  def restore_extra(self, step: int | None = None) -> dict | None:
    """The `extra` tree saved with `step` (numpy arrays), or None if it had none."""
    step = self.latest_step() if step is None else step
    if not self.read_meta(step).get("has_extra"):
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        extra=ocp.args.StandardRestore()))
    return jax.tree.map(np.asarray, restored.extra)

  def restore(self, abstract: engine_lib.TrainState, step: int | None = None):
    """(logical TrainState, meta dict) of `step` (default: latest), sharded as `abstract` says.

    The unit axes of the logical form carry zeros after the last unit up to a multiple of the
    tensor devices; restoring onto another device count pads or cuts those zeros (`strict=False`:
    the model itself was checked against the meta before). Values saved in another dtype
    (a run that changed `model.param_dtype` or `optimizer.mu_dtype`) are cast to `abstract`'s.
    """
    step = self.latest_step() if step is None else step
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract, strict=False), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def restore_parts(self, abstract, step: int | None = None):
    """`restore` of a tree some of whose leaves are `SKIP`: those are not read (and come back
    as `SKIP`), e.g. the layers of another process's pipeline stage, which could not be placed
    on this process's devices. Read with a checkpointer of its own (the manager's handler
    for the state does not take such trees)."""
    step = self.latest_step() if step is None else step
    args = jax.tree.map(lambda r: dataclasses.replace(r, strict=False)
                        if isinstance(r, ocp.ArrayRestoreArgs) else r,
                        ocp.checkpoint_utils.construct_restore_args(abstract))
    with ocp.PyTreeCheckpointer() as reader:
      state = reader.restore(os.path.join(self.folder(step), "state"),
                             args=ocp.args.PyTreeRestore(item=abstract, restore_args=args))
    return state, self.read_meta(step)

  def restore_snapshot(self, abstract, step: int | None = None):
    """The logical snapshot saved with `step` (sharded as `abstract`), or None."""
    step = self.latest_step() if step is None else step
    if not self.read_meta(step).get("has_snapshot"):
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        snapshot=ocp.args.StandardRestore(abstract, strict=False)))
    return restored.snapshot

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
