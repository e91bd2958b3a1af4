"""semijax's training step against the same model written plainly in JAX: the GPT
(`benchmarks/plain_gpt.py`) or, with `model="llama"`, the Llama (`benchmarks/plain_llama.py`,
`kv_heads` key/value heads; its "heads" units are KV groups).

Three programs per precision, each a full training step (forward, backward, AdamW with the
same `semijax.train.optimizer` settings), from the same initial parameters, on the same batch:

  plain     `jax.jit` of a pure function of a parameter dict, no shard_map; on N devices the
            batch is split over them (data parallel, parameters replicated), on one it is plain;
  even      semijax's engine, an even split over the N tensor devices, the single-width step;
  uneven    semijax's engine, device 0 owning `uneven` times the others' share of each unit kind
            (`layout.proportional_counts`), the branched step over `num_widths` widths. On one
            device the split cannot be uneven: the device owns every unit and computes all of
            them through the `lax.switch` over the widths, so the cell measures what branching
            costs.

Every step is synced on its loss. The programs run in interleaved rounds (`benchmarks.rounds`:
every program of every precision once per round, in an order that changes from round to round),
each round one untimed step and `steps` timed ones per program; a cell reports the median over
rounds of the round medians, with the rounds' min and max, model TFLOP/s
(`benchmarks.mfu.step_flops` of the whole model over the median), and the ratio of semijax's
round median over the plain one of the same precision and round (its median over rounds).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from benchmarks import hlo as hlo_lib
from benchmarks import mfu
from benchmarks import plain_gpt
from benchmarks import plain_llama
from benchmarks import report
from benchmarks import rounds as rounds_lib
from semijax import models
from semijax.core import engine as engine_lib
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import plan as plan_lib
from semijax.core import precision as precision_lib
from semijax.errors import ConfigError
from semijax.train import optimizer as optimizer_lib

PRECISIONS = ("float32", "bfloat16")
MODELS = {"gpt": plain_gpt, "llama": plain_llama}
PROGRAMS = ("plain", "even", "uneven")
VOCAB = 256
WARM_STEPS = 3
SCHEDULE_STEPS = 1000     # the optimizer's schedule (warmup, then cosine decay): any length works


@dataclasses.dataclass(frozen=True)
class Settings:
  """The benchmark's flags (experiments/bench_peer.py), checked by `validate`."""

  precision: tuple[str, ...] = PRECISIONS
  attention: str = "auto"
  model: str = "gpt"
  kv_heads: int = 0          # llama: key/value heads (0: as many as heads); gpt: 0
  d_model: int = 128
  d_ff: int = 512
  heads: int = 16
  layers: int = 2
  seq_len: int = 64
  batch: int = 8
  tensor: int = 1
  uneven: float = 0.5
  num_widths: int = 4
  steps: int = 10
  rounds: int = 5
  seed: int = 0

  def validate(self, device_count: int, backend: str) -> "Settings":
    """Raises ConfigError naming the flag of the first bad value."""
    if not self.precision or len(set(self.precision)) != len(self.precision):
      raise ConfigError(f"--precision: give each of {PRECISIONS} at most once, got "
                        f"{list(self.precision)}")
    for p in self.precision:
      if p not in PRECISIONS:
        raise ConfigError(f"--precision: {p!r} is not one of {PRECISIONS}")
    if self.attention not in precision_lib.ATTENTION:
      raise ConfigError(f"--attention: {self.attention!r} is not one of "
                        f"{precision_lib.ATTENTION}")
    if self.attention == "cudnn" and (backend != "gpu" or "float32" in self.precision):
      raise ConfigError(f"--attention: 'cudnn' needs a CUDA GPU and --precision=bfloat16 only "
                        f"(backend {backend!r}, precision {list(self.precision)}); use 'auto'")
    for name in ("d_model", "d_ff", "heads", "layers", "seq_len", "batch", "tensor", "steps",
                 "rounds"):
      if getattr(self, name) < 1:
        raise ConfigError(f"--{name}: must be >= 1, got {getattr(self, name)}")
    if self.model not in MODELS:
      raise ConfigError(f"--model: {self.model!r} is not one of {tuple(MODELS)}")
    if self.d_model % self.heads:
      raise ConfigError(f"--heads: {self.heads} heads do not divide --d_model={self.d_model}")
    if self.kv_heads and self.model != "llama":
      raise ConfigError(f"--kv_heads: the {self.model} has no key/value groups; give it with "
                        "--model=llama")
    if self.model == "llama":
      try:
        spec(self, "float32")
      except ConfigError as e:
        raise ConfigError(f"--{_flag(e)}: {str(e).split(': ', 1)[1]}") from None
    if self.tensor > device_count:
      raise ConfigError(f"--tensor: {self.tensor} devices, but only {device_count} are "
                        "available")
    heads = self.kv_heads or self.heads       # the "heads" units: KV groups for a llama
    if min(heads, self.d_ff) < self.tensor:
      raise ConfigError(f"--tensor: {self.tensor} devices cannot each own a head and an MLP "
                        f"unit of {heads} heads units, --d_ff={self.d_ff}")
    if self.batch % self.tensor:
      raise ConfigError(f"--batch: {self.batch} does not split over the plain program's "
                        f"{self.tensor} devices (--tensor)")
    if not 0 < self.uneven <= 1:
      raise ConfigError(f"--uneven: device 0's share relative to the others' must be in (0, 1], "
                        f"got {self.uneven}")
    if self.num_widths < 2:
      raise ConfigError(f"--num_widths: the uneven step branches over >= 2 widths, got "
                        f"{self.num_widths}")
    return self


# semijax's config field of each flag whose name differs.
_FLAGS = {"num_heads": "heads", "num_kv_heads": "kv_heads", "num_layers": "layers"}


def _flag(error: ConfigError) -> str:
  """The flag of a `config.model.<field>: ...` refusal."""
  field = str(error).split(":", 1)[0].rsplit(".", 1)[-1]
  return _FLAGS.get(field, field)


def spec(s: Settings, precision: str):
  """semijax's ModelSpec of the benchmark's model in `precision` (master weights float32)."""
  fields = dict(vocab_size=VOCAB, seq_len=s.seq_len, d_model=s.d_model, num_heads=s.heads,
                d_ff=s.d_ff, num_layers=s.layers, dtype=precision, param_dtype="float32",
                attention=s.attention)
  if s.model == "llama":
    fields["num_kv_heads"] = s.kv_heads or s.heads
  return models.spec(s.model, fields)


def layouts(s: Settings) -> dict:
  """{"even": the even split, "uneven": device 0 with `s.uneven` of the others' share}, both with
  `s.num_widths` compiled widths per kind."""
  units = spec(s, "float32").num_units()      # heads: KV groups for a llama
  kw = dict(d_model=s.d_model, num_heads=units["heads"], d_ff=s.d_ff, num_devices=s.tensor,
            num_widths=s.num_widths)
  speeds = (s.uneven,) + (1.0,) * (s.tensor - 1)
  counts = {k: layout_lib.proportional_counts(n, speeds) for k, n in units.items()}
  return {"even": layout_lib.Layout.for_model(**kw),
          "uneven": layout_lib.Layout.for_model(**kw, **counts)}


def plain_params(logical: dict, model: str = "gpt") -> dict:
  """semijax logical parameters (host arrays, `Engine.logical_arrays`) -> `plain_gpt`'s dict
  (`plain_llama`'s for model "llama")."""
  enc = logical["encoder"]
  blocks = [enc["blocks"][i] for i in sorted(enc["blocks"])]
  if model == "llama":
    return {"embed": logical["embed"]["embedding"], "head": logical["head"]["kernel"],
            "final_norm": enc["final_norm"]["scale"],
            "blocks": [{"attn_norm": b["attn_norm"]["scale"], "mlp_norm": b["mlp_norm"]["scale"],
                        "attn": dict(b["attn"]), "mlp": dict(b["mlp"])} for b in blocks]}
  return {"embed": logical["embed"]["embedding"], "pos": logical["pos"],
          "head": logical["head"]["kernel"], "ln_f": dict(enc["ln_f"]),
          "blocks": [{"ln1": dict(b["ln1"]), "ln2": dict(b["ln2"]), "attn": dict(b["attn"]),
                      "mlp": dict(b["mlp"])} for b in blocks]}


def batch(s: Settings) -> dict:
  """A fixed batch of random bytes: {"inputs", "targets": int32 [batch, seq_len]} (host)."""
  tokens = np.random.default_rng(s.seed).integers(0, VOCAB, (s.batch, s.seq_len + 1))
  return {"inputs": tokens[:, :-1].astype(np.int32), "targets": tokens[:, 1:].astype(np.int32)}


class Program:
  """A training step that owns its state: each call runs one step and returns its loss.
  `collectives`: `hlo.all_reduces` of its compiled step, where known (semijax's)."""

  def __init__(self, step, state, collectives: dict | None = None):
    self._step, self._state, self.collectives = step, state, collectives

  def __call__(self) -> jax.Array:
    self._state, loss = self._step(self._state)
    return loss


def semijax_programs(s: Settings, precision: str, host_batch: dict):
  """({"even": Program, "uneven": Program}, the engine) for `precision`; every branch of the
  uneven step has run once (`Engine.exercise`)."""
  model_fn, loss_terms = models.build(spec(s, precision))
  tx = optimizer_lib.make(optimizer_lib.OptimizerSpec(), SCHEDULE_STEPS)
  engine = engine_lib.Engine(model_fn, loss_terms, mesh_lib.make_mesh(1, s.tensor), tx)
  sharded = engine.shard_batch(host_batch)
  out = {}
  for name, lay in layouts(s).items():
    widths = plan_lib.uniform_widths(lay) if name == "even" else None
    plan = engine.plan(lay, widths=widths)
    state = engine.init(s.seed, lay)
    engine.exercise(state, sharded, plan)       # every branch's first run, untimed

    def step(state, plan=plan):
      state, metrics = engine.train_step(state, sharded, plan)
      return state, metrics["loss"]
    compiled = engine.programs.compiled_fn("train", state, sharded, plan)
    out[name] = Program(step, state, hlo_lib.all_reduces(compiled.as_text()))
  return out, engine


def plain_program(s: Settings, precision: str, engine, host_batch: dict) -> Program:
  """The plain-JAX step for `precision` on the engine's devices, from the engine's initial
  parameters (the same seed)."""
  devices = engine.mesh.devices.reshape(-1)
  mesh = jax.sharding.Mesh(devices, ("batch",))
  replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("batch"))
  logical = engine.logical_arrays(engine.init_logical(s.seed))
  params = jax.device_put(plain_params(logical.params, s.model), replicated)
  tx = optimizer_lib.make(optimizer_lib.OptimizerSpec(), SCHEDULE_STEPS)
  opt_state = jax.device_put(tx.init(params), replicated)
  data = jax.device_put(host_batch, split)
  impl = spec(s, precision).precision.attention_impl(s.d_model // s.heads)
  fn = jax.jit(lambda p, o, b: MODELS[s.model].train_step(
      p, o, b, tx=tx, num_heads=s.heads, dtype=jnp.dtype(precision), implementation=impl),
      donate_argnums=(0, 1), out_shardings=replicated)

  def step(state):
    p, o, loss = fn(*state, data)
    return (p, o), loss
  return Program(step, (params, opt_state))


def time_round(program: Program, steps: int) -> list[float]:
  """Seconds of each of `steps` steps, each synced on its loss, after one untimed step."""
  jax.block_until_ready(program())
  times = []
  for _ in range(steps):
    t = time.perf_counter()
    jax.block_until_ready(program())
    times.append(time.perf_counter() - t)
  return times


def run(s: Settings, after_round: Callable[[dict], None] | None = None) -> dict:
  """Builds, warms up and times every (precision, program) cell in `s.rounds` interleaved
  rounds; returns the JSON payload, and hands the payload of the rounds so far to
  `after_round` after each."""
  host_batch = batch(s)
  cells, first_loss, layout_json, collectives = {}, {}, {}, {}
  for precision in s.precision:
    semi, engine = semijax_programs(s, precision, host_batch)
    programs = {"plain": plain_program(s, precision, engine, host_batch), **semi}
    for name in PROGRAMS:
      first_loss[(precision, name)] = float(programs[name]())
      for _ in range(WARM_STEPS - 1):
        jax.block_until_ready(programs[name]())
      cells[(precision, name)] = programs[name]
      collectives[(precision, name)] = programs[name].collectives
  for name, lay in layouts(s).items():     # the widths each step compiles
    widths = plan_lib.uniform_widths(lay) if name == "even" else None
    layout_json[name] = {k: {"counts": list(u.counts), "widths": list((widths or {}).get(
        k, u.widths))} for k, u in lay.kinds().items()}
  keys = {f"{p}/{name}": (p, name) for p, name in cells}
  measures = {k: (lambda prog=cells[key]: 1e3 * float(np.median(time_round(prog, s.steps))))
              for k, key in keys.items()}
  flops = mfu.step_flops(spec(s, "float32"), spec(s, "float32").num_units(),
                         s.batch * s.seq_len, VOCAB)

  def payload(figures):
    return _payload(s, {keys[k]: v for k, v in figures.items()}, first_loss, layout_json, flops,
                    collectives)
  after = None if after_round is None else (lambda figures: after_round(payload(figures)))
  return payload(rounds_lib.interleave(measures, s.rounds, after_round=after))


def _payload(s: Settings, round_ms: dict, first_loss: dict, layout_json: dict,
             flops: float, collectives: dict) -> dict:
  """The JSON payload of the rounds done ({(precision, program): [ms per round]}); each
  semijax cell says how many all-reduces its compiled step has, and how many of them run over
  one device (none where the tensor axis is one device: `mesh.lowering_scope`)."""
  out_cells = []
  for (precision, name), ms in round_ms.items():
    median = float(np.median(ms))
    out_cells.append({
        "precision": precision, "program": name, "round_ms": ms, "median_ms": median,
        "min_ms": min(ms), "max_ms": max(ms), "tflops": flops / (median * 1e-3) / 1e12,
        "first_loss": first_loss[(precision, name)],
        **(collectives[(precision, name)] or {}),
        "attention": spec(s, precision).precision.attention_impl(s.d_model // s.heads)})
  ratios = [{"precision": p,
             **{f"{name}_over_plain": rounds_lib.ratio_stats(
                 round_ms[(p, name)], round_ms[(p, "plain")])["median"]
                for name in ("even", "uneven")}} for p in s.precision]
  device = jax.devices()[0]
  return {"settings": dataclasses.asdict(s), "backend": jax.default_backend(),
          "device": device.device_kind, "devices": s.tensor, "jax": jax.__version__,
          "model_flops": flops, "layouts": layout_json, "cells": out_cells, "ratios": ratios,
          "rounds_done": min(len(v) for v in round_ms.values())}


PROGRAM_NAMES = {"plain": "plain JAX", "even": "semijax even", "uneven": "semijax uneven"}


def table(payload: dict) -> str:
  """The markdown table of a payload of `run`."""
  rounds = {(c["precision"], c["program"]): c["round_ms"] for c in payload["cells"]}
  rows = [[c["precision"], c["attention"], PROGRAM_NAMES[c["program"]], c["median_ms"],
           f"{c['min_ms']:.3g}-{c['max_ms']:.3g}", c["tflops"], rounds_lib.cell(
               rounds_lib.ratio_stats(c["round_ms"], rounds[(c["precision"], "plain")]), ".2f")]
          for c in payload["cells"]]
  return report.markdown_table(["precision", "attention", "program", "ms/step (median)",
                                "min-max of rounds", "model TFLOP/s",
                                "x plain, per round (min-max)"], rows)
