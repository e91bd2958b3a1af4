"""Orbax checkpoints of the *logical* train state, with the layout stored beside it.

A checkpoint holds layout-independent parameters and optimizer state (every unit axis in logical
order, no padding), so it restores onto any layout, capacity bucket or tensor device count: the
engine packs it into the new padded layout. Beside it, a JSON item records the step, the data
position, the layout it was trained with and the model config (a checkpoint is never restored
into a different model).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from semijax.core import engine as engine_lib


class Checkpointer:
  """Saves and restores logical train states under `directory` (one sub-folder per step)."""

  def __init__(self, directory: str, keep: int = 2):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def save(self, step: int, logical: engine_lib.TrainState, meta: dict,
           extra: dict | None = None) -> None:
    """Saves and waits until the checkpoint is committed (so a crash later cannot lose it).

    `extra`: optional host state (a tree of numpy arrays, e.g. resize priority scores).
    """
    items = dict(state=ocp.args.StandardSave(logical),
                 meta=ocp.args.JsonSave(dict(meta, step=step, has_extra=extra is not None)))
    if extra is not None:
      items["extra"] = ocp.args.StandardSave(extra)
    self._manager.save(step, args=ocp.args.Composite(**items))
    self._manager.wait_until_finished()

  def restore_extra(self, step: int | None = None) -> dict | None:
    """The `extra` tree saved with `step` (numpy arrays), or None if it had none."""
    step = self.latest_step() if step is None else step
    if not self.read_meta(step).get("has_extra"):
      return None
    restored = self._manager.restore(step, args=ocp.args.Composite(
        extra=ocp.args.StandardRestore()))
    return jax.tree.map(np.asarray, restored.extra)

  def restore(self, abstract: engine_lib.TrainState, step: int | None = None):
    """(logical TrainState, meta dict) of `step` (default: latest); `abstract` gives shardings."""
    step = self.latest_step() if step is None else step
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
    return restored.state, restored.meta

  def read_meta(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
