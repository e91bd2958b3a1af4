"""Orbax checkpoints of the *logical* train state, with the layout stored beside it.

A checkpoint holds layout-independent parameters and optimizer state (every unit axis in logical
order; zeros appended up to a multiple of the tensor devices when they do not divide the units),
saved sharded as the devices hold them (`Engine.to_logical`), so it restores onto any layout,
capacity bucket or tensor device count: the engine moves it into the new padded layout. Beside
it, a JSON item records the step, the data position, the layout it was trained with and the
model config (a checkpoint is never restored into a different model).
"""

from __future__ import annotations

import os

import jax
import numpy as np
import orbax.checkpoint as ocp

from semijax.core import engine as engine_lib


def param_dtypes(params) -> list[str]:
  """The dtypes a parameter tree is stored in, sorted (what a checkpoint's meta records)."""
  return sorted({str(x.dtype) for x in jax.tree.leaves(params)})


def dtype_change(meta: dict, abstract: engine_lib.TrainState) -> str:
  """"" when `abstract`'s parameters have the dtypes the checkpoint stored (or it did not record
  them), else a clause for the resume line: restoring casts every value to the new dtype."""
  saved, now = meta.get("param_dtypes"), param_dtypes(abstract.params)
  return "" if saved in (None, now) else f"; parameters stored in {'/'.join(saved)}, " \
      f"restored into {'/'.join(now)}"


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
