"""Shared test fixtures: tiny models, random uneven layouts, batches, reference comparisons."""

from __future__ import annotations

import contextlib
import glob
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dense_reference as ref
from semijax.balance import decisions
from semijax.core import engine as engine_lib
from semijax.core import layout as L
from semijax.core import mesh as mesh_lib
from semijax.models import gpt, vit
from semijax.models import tasks
from semijax.sync import settings as sync_settings
from semijax.sync import timeline as timeline_lib
from semijax.train import checkpoint as checkpoint_lib
from semijax.train import config as config_lib
from semijax.train import metrics

GPT_KW = dict(vocab_size=64, seq_len=8, d_model=32, num_heads=8, d_ff=48, num_layers=2)
VIT_KW = dict(image_size=8, patch_size=2, channels=1, num_classes=10, d_model=32, num_heads=8,
              d_ff=48, num_layers=2)
MODELS = {
    "gpt": (gpt.GPT, ref.GPT, GPT_KW, tasks.language_model),
    "vit": (vit.ViT, ref.ViT, VIT_KW, tasks.classification),
}


def make_engine(name, data=1, tensor=8, tx=None, precision=None, **kw):
  """An engine of the tiny `name` model on a (data, tensor) mesh; `precision` a
  `core.precision.Precision` (default float32)."""
  model_cls, _, model_kw, task = MODELS[name]
  if precision is not None:
    model_kw = dict(model_kw, precision=precision)
  mesh = mesh_lib.make_mesh(data, tensor)
  tx = tx or optax.adamw(1e-2, weight_decay=0.1)
  return engine_lib.Engine(lambda rngs: model_cls(rngs=rngs, **model_kw), task, mesh, tx, **kw)


def random_unit_layout(rng, kind, num_units, n, extra_capacity=1):
  """A random uneven, *non-contiguous* ownership in which one device owns exactly one unit."""
  cuts = np.sort(rng.choice(np.arange(1, num_units), size=n - 1, replace=False))
  counts = np.diff(np.concatenate([[0], cuts, [num_units]]))
  if n > 1:
    d = int(rng.integers(n))
    counts[(d + 1) % n] += counts[d] - 1
    counts[d] = 1
  perm = rng.permutation(num_units)
  starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
  owned = tuple(tuple(int(u) for u in perm[s:s + c]) for s, c in zip(starts, counts))
  capacity = int(counts.max()) + extra_capacity
  return L.UnitLayout(kind, num_units, owned, capacity, tuple(int(c) for c in counts),
                      L.default_widths(capacity))


def random_layout(seed, n, model="gpt"):
  rng = np.random.default_rng(seed)
  kw = MODELS[model][2]
  return L.Layout(mlp=random_unit_layout(rng, "mlp", kw["d_ff"], n),
                  heads=random_unit_layout(rng, "heads", kw["num_heads"], n))


def even_layout(n, model="gpt"):
  kw = MODELS[model][2]
  return L.Layout.for_model(d_model=kw["d_model"], num_heads=kw["num_heads"], d_ff=kw["d_ff"],
                            num_devices=n)


def make_batch(model, seed=0, batch_size=4):
  rng = np.random.default_rng(seed)
  if model == "gpt":
    kw = GPT_KW
    toks = rng.integers(0, kw["vocab_size"], (batch_size, kw["seq_len"] + 1)).astype(np.int32)
    return {"inputs": toks[:, :-1], "targets": toks[:, 1:]}
  kw = VIT_KW
  images = rng.normal(size=(batch_size, kw["image_size"], kw["image_size"], kw["channels"]))
  return {"images": images.astype(np.float32),
          "labels": rng.integers(0, kw["num_classes"], batch_size).astype(np.int32)}


def reference_loss_fn(model, logical_params):
  """(graphdef, ref params, loss(ref_params, batch) -> (loss, logits)) of the dense reference."""
  _, ref_cls, kw, _ = MODELS[model]
  graphdef, ref_params = ref.build(ref_cls, logical_params, **kw)
  def loss(p, batch):
    inputs = batch["inputs"] if model == "gpt" else batch["images"]
    labels = batch["targets"] if model == "gpt" else batch["labels"]
    logits = ref.apply(graphdef, p, jnp.asarray(inputs))
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, jnp.asarray(labels)[..., None], -1)), logits
  return graphdef, ref_params, loss


def reference_logits_and_grads(model, logical_params, batch):
  """Dense reference logits and logical-layout gradients, in one compiled program."""
  _, ref_params, loss = reference_loss_fn(model, logical_params)
  fn = jax.jit(jax.grad(loss, has_aux=True))
  grads, logits = fn(ref_params, batch)
  return logits, ref.from_reference(grads)


def logits_and_grads(eng, params, batch, plan):
  """Engine logits and parameter gradients (padded), in one compiled program."""
  def fn(p, b, pl):
    return eng.logits(p, b, pl), jax.grad(lambda p: eng.loss(p, b, pl)[0])(p)
  return jax.jit(fn)(params, batch, plan)


def assert_trees_close(actual, expected, atol, rtol=1e-5):
  paths = jax.tree_util.tree_leaves_with_path(expected)
  for (path, e), a in zip(paths, jax.tree.leaves(actual)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), atol=atol, rtol=rtol,
                               err_msg=jax.tree_util.keystr(path))
  assert jax.tree.structure(actual) == jax.tree.structure(expected)


def split_slots(eng, padded_tree, layout):
  """Yields (kind, axis names, owned entries, padding entries) of each unit-axis array."""
  masks = {k: u.owned_mask() for k, u in layout.kinds().items()}
  for a, x in zip(jax.tree.leaves(eng.axes), jax.tree.leaves(padded_tree)):
    if (unit := a.unit()) is None:
      continue
    axis, kind = unit
    x = np.moveaxis(np.asarray(x), axis, 0).reshape(len(masks[kind]), -1)
    yield kind, a.names, x[masks[kind]], x[~masks[kind]]


BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_backend_compiles():
  events = []
  listener = lambda name, secs, **kw: events.append(name) if name == BACKEND_COMPILE else None
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listener)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name, arg="cpu"):
  return config_lib.load(os.path.join(ROOT, "configs", f"{name}.py:{arg}"))


def peer_semijax_loss(s, precision, layout_name):
  """(semijax's mean loss of the peer benchmark's batch in its layout `layout_name`, the logical
  host params) for `benchmarks.peer.Settings` `s`."""
  from benchmarks import peer                    # benchmark code, only for the peer tests
  from semijax import models
  from semijax.train import optimizer as optimizer_lib
  model_fn, loss_terms = models.build(peer.spec(s, precision))
  tx = optimizer_lib.make(optimizer_lib.OptimizerSpec(), 10)
  engine = engine_lib.Engine(model_fn, loss_terms, mesh_lib.make_mesh(1, s.tensor), tx)
  lay = peer.layouts(s)[layout_name]
  state = engine.init(s.seed, lay)
  loss, _ = jax.jit(engine.loss)(state.params, engine.shard_batch(peer.batch(s)),
                                 engine.plan(lay))
  return float(loss), engine.logical_arrays(engine.init_logical(s.seed)).params


def tiny_run(config: str, model: dict, tensor=4, steps=6, **layout):
  """The `config` file's cpu variant (e.g. "gpt_tiny") with `model` fields, shrunk so a run
  compiles in seconds; `layout` sets config.layout fields."""
  c = load(config, f"cpu,tensor={tensor}")
  c.model.update(model)
  c.layout.num_widths = 2
  c.batch_size, c.steps = 8, steps
  c.eval_every = c.log_every = 1
  c.checkpoint_every = 3
  c.data.eval_batches = 1
  c.optimizer.warmup_steps = 2
  for kind, counts in layout.items():
    c.layout[kind] = counts
  return c


def tiny_gpt(tensor=4, steps=6, **layout):
  """gpt_tiny shrunk so a run compiles in seconds."""
  return tiny_run("gpt_tiny", dict(seq_len=16, d_model=32, num_heads=8, d_ff=64, num_layers=1),
                  tensor, steps, **layout)


def record_closes(monkeypatch) -> list:
  """Makes Checkpointer.close and DecisionLog.close append their class name to the returned
  list (and still close)."""
  closed = []
  for cls in (checkpoint_lib.Checkpointer, decisions.DecisionLog):
    def close(self, original=cls.close, name=cls.__name__):
      closed.append(name)
      original(self)
    monkeypatch.setattr(cls, "close", close)
  return closed


# --- runs stopped and resumed ------------------------------------------------------------------


class Interrupt(Exception):
  """The crash `interrupted` stages."""


def interrupted(monkeypatch, run, calls, cls=engine_lib.Engine, name="train_step"):
  """Calls `run()` with `cls.name` raising Interrupt on its call number `calls + 1` (a crash
  mid-run), and checks that the run ended there."""
  original = getattr(cls, name)
  count = {"n": 0}

  def patched(self, *a, **kw):
    count["n"] += 1
    if count["n"] > calls:
      raise Interrupt()
    return original(self, *a, **kw)
  with monkeypatch.context() as m:
    m.setattr(cls, name, patched)
    with pytest.raises(Interrupt):
      run()


def check_replica_resume(train, config, tmp_path, monkeypatch, cls, name):
  """A replica run (`config()`: 5 updates, checkpoint_every=3) stopped in its fifth update by
  `cls.name` and resumed continues exactly as the run never stopped: same losses, validation
  loss and microbatches per replica. Returns the resumed run's workdir. `train(config, workdir)`
  runs one."""
  reference = train(config(), tmp_path / "ref")
  workdir = tmp_path / "run"
  interrupted(monkeypatch, lambda: train(config(), workdir), 4, cls, name)
  assert sorted(os.listdir(workdir / "checkpoints")) == ["3"]
  resumed = train(config(), workdir)
  assert resumed["start_step"] == 3
  assert resumed["losses"] == reference["losses"][3:]
  assert resumed["val/loss"] == reference["val/loss"]
  assert resumed["sync"]["microbatches"] == reference["sync"]["microbatches"]
  return workdir


def check_scaled_replica_run(train, config, tmp_path, monkeypatch, cls, name):
  """`config()` (as for `check_replica_resume`) under dynamic loss scaling doubling every 2
  updates (an update: one round, one local step) trains like the unscaled run (a power-of-two scale is exact in float32; the clip's
  norm fuses differently, so within 1e-6) and logs the scale each update used; stopped and
  resumed, it continues its scale exactly (`check_replica_resume`)."""
  def logged(**fields):
    c = config()
    c.log_every = 1
    c.optimizer.update(fields)
    return c
  train(logged(), tmp_path / "plain")
  scaled = lambda: logged(loss_scale="dynamic", loss_scale_period=2)
  workdir = check_replica_resume(train, scaled, tmp_path, monkeypatch, cls, name)
  plain, ref, resumed = (metrics.read_jsonl(str(tmp_path / d / "metrics.jsonl"))
                         for d in ("plain", "ref", workdir.name))
  losses = lambda records: [r.get("train/loss", np.nan) for r in records]
  np.testing.assert_allclose(losses(ref), losses(plain), rtol=1e-6)
  scales = {r["step"]: r["train/loss_scale"] for r in ref}
  assert list(scales.values()) == [2.0 ** (15 + i // 2) for i in range(len(ref))]
  assert all(scales[r["step"]] == r["train/loss_scale"] for r in resumed)
  assert len(ref) >= 5 and "train/loss_scale" not in plain[0]


# --- replica runs (tensor-parallel replicas or pipelines) ---------------------------------------


def check_equal_replicas_train_like_sync(train, config, tmp_path, steps, batch_size):
  """`config(mode)` on equal replicas: ssaw and async take exactly sync's `steps` steps
  (bit-identical losses and validation loss) on the same samples."""
  reference = train(config("sync"), tmp_path / "sync")
  for mode in ("ssaw", "async"):
    out = train(config(mode), tmp_path / mode)
    assert out["losses"] == reference["losses"], mode
    assert out["val/loss"] == reference["val/loss"], mode
    assert out["steps"] == steps and out["sync"]["samples"] == steps * batch_size, mode


def check_every_microbatch_once(out, workdir, steps, replicas, batch_size, bound) -> list:
  """A replica run of `steps` steps with slow replicas: each of the budget's steps x replicas
  microbatches was applied exactly once, in more updates than steps, and the stalest gradient
  applied was 1 to `bound` updates old. Returns the microbatches each replica computed."""
  owned = out["sync"]["microbatches"]
  assert sorted(j for m in owned for j in m) == list(range(steps * replicas))
  assert out["sync"]["samples"] == steps * batch_size and out["steps"] > steps
  records = metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  assert 1 <= max(r["sync/max_staleness"] for r in records) <= bound
  return owned


def timeline_rounds(speeds, mode="ssaw", steps=6, microbatch=2, **kw) -> list:
  """Every round `sync.timeline.Timeline` closes in a run of `steps` global batches whose
  replica r takes speeds[r] seconds per microbatch (`kw`: more `SyncSettings` fields)."""
  s = sync_settings.SyncSettings(mode=mode, **kw)
  line = timeline_lib.Timeline(s, len(speeds), microbatch, steps * len(speeds))
  line.start(speeds)
  rounds = []
  while (rnd := line.take()) is not None:
    rounds.append(rnd)
    line.start(speeds)
  return rounds


def checkpoint_arrays(folder):
  """The array data files of a checkpoint folder (Orbax's OCDBT chunks), largest first."""
  files = glob.glob(os.path.join(folder, "state", "**", "d", "*"), recursive=True)
  return sorted(files, key=os.path.getsize, reverse=True)


def flip_bytes(folder):
  """Inverts 4 bytes in the middle of the checkpoint's largest array file."""
  path = checkpoint_arrays(folder)[0]
  with open(path, "r+b") as f:
    f.seek(os.path.getsize(path) // 2)
    b = f.read(4)
    f.seek(-4, os.SEEK_CUR)
    f.write(bytes(x ^ 0xFF for x in b))


def truncate_array(folder):
  path = checkpoint_arrays(folder)[0]
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)


def remove_array(folder):
  os.remove(checkpoint_arrays(folder)[-1])


def garble_metadata(folder):
  with open(os.path.join(folder, "meta", "metadata"), "wb") as f:
    f.write(b"\x00garbage{")


def cut_short(folder):
  os.remove(os.path.join(folder, checkpoint_lib.CHECKSUMS))


# {damage: (what does it to a checkpoint folder, a regex of what the run then says)}
CHECKPOINT_DAMAGE = {"truncated array file": (truncate_array, "bytes, .* were written"),
                     "flipped bytes": (flip_bytes, "does not match its checksum"),
                     "missing file": (remove_array, "is missing"),
                     "garbled metadata": (garble_metadata, "meta/metadata"),
                     "no checksum record": (cut_short, "no checksum record")}


def job_process_pid(marker: str, process_id: int) -> int | None:
  """The pid of process `process_id` of a `semijax.runtime.launch` job whose command line holds
  `marker` (e.g. its workdir), found through /proc (Linux); None if it is not running."""
  for entry in os.listdir("/proc"):
    if not entry.isdigit():
      continue
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        cmdline = f.read()
      with open(f"/proc/{entry}/environ", "rb") as f:
        environ = f.read().split(b"\0")
    except OSError:         # gone, or not ours
      continue
    if (marker.encode() in cmdline and
        f"SEMIJAX_PROCESS_ID={process_id}".encode() in environ):
      return int(entry)
  return None
