r"""Cost of lossless migration and of the offload baseline, relative to one training step.

For the gpt_tiny CPU config and a wider model (d_model 1024, one layer), on 8 fake tensor
devices: move 1, 5 and 25 percent of ONE device's units (device 0 gives its last units to the
other seven in turn) and report

  * bytes moved (units that change owner: weights, biases and both Adam moments of every layer),
    the bytes the policy path's all_to_all carries (`Engine.move`: chunk "sized", the smallest of
    a few precompiled chunk sizes that fits, one group of leaves at a time, as a running policy
    migrates) and the bytes of an all-gather of the padded state (what chunk = capacity carries,
    and what a move through a replicated logical copy cost before);
  * the median time of one policy-path migration, over the median time of one training step;
  * a bucket switch (device 1 receives so many units that its capacity grows), also on the
    policy path;
  * offload: the same units computed by helpers every step, as the extra time of forward +
    backward of one attention + MLP block with offload over the block without, times the layers,
    over the training step. On one host the fake devices share the cores, so this shows the
    overhead offload adds, not the straggler's saving.

  python experiments/bench_migrate.py --out=results/bench_migrate [--quick]
"""

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from semijax.runtime import launch  # noqa: E402

# 8 fake CPU devices unless the caller chose a device count (read when the backend starts).
launch.default_device_count(8)

from absl import app, flags  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# The repository root: benchmarks/ (benchmark and report code) lives beside the library.
from benchmarks import report  # noqa: E402
from semijax.core import layout as layout_lib  # noqa: E402
from semijax.core import migrate  # noqa: E402
from semijax.core import offload  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.train import config as config_lib  # noqa: E402
from semijax.train import loop as train  # noqa: E402

_OUT = flags.DEFINE_string("out", "results/bench_migrate", "Where to write the results.")
_QUICK = flags.DEFINE_bool("quick", False, "Fewer repeats and a shorter wide model (CI).")
_REPEATS = flags.DEFINE_integer("repeats", 0, "Timed calls per measurement (0 = 3 quick, 7).")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARES = (0.01, 0.05, 0.25)


def configs(quick):
  tiny = config_lib.load(os.path.join(ROOT, "configs", "gpt_tiny.py:cpu"))
  wide = config_lib.load(os.path.join(ROOT, "configs", "gpt_tiny.py:cpu"))
  wide.model.update(dict(d_model=1024, d_ff=4096, num_layers=1, seq_len=32 if quick else 64))
  wide.batch_size = 8
  return {"gpt_tiny": tiny, "wide_d1024": wide}


def median_s(fn, repeats):
  jax.block_until_ready(fn())                       # warm (compiled before)
  times = []
  for _ in range(repeats):
    t = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t)
  return float(np.median(times))


def shares_moves(layout, share):
  """{kind: [(unit, helper)]}: device 0's last round(share * count) units, to devices 1.. in turn
  (at least one MLP unit)."""
  out = {}
  for kind, u in layout.kinds().items():
    n = math.floor(share * u.counts[0] + 0.5)
    n = max(n, 1) if kind == "mlp" else n
    units = u.owned[0][len(u.owned[0]) - n:]
    out[kind] = [(x, 1 + i % (u.num_devices - 1)) for i, x in enumerate(units)]
  return out


def base_layout(config, n):
  """Even counts, capacity with room for the largest share's units on every helper."""
  m = config.model
  even = layout_lib.Layout.for_model(d_model=m.d_model, num_heads=m.num_heads, d_ff=m.d_ff,
                                     num_devices=n)
  biggest = shares_moves(even, max(SHARES))
  cap = {k: max(u.counts) + math.ceil(len(biggest[k]) / (n - 1)) for k, u in even.kinds().items()}
  return layout_lib.Layout.for_model(d_model=m.d_model, num_heads=m.num_heads, d_ff=m.d_ff,
                                     num_devices=n, capacity=cap)


def block_fn(engine, layout, plans, x):
  """Jitted forward + backward of one attention + MLP block with offload plans (8 devices)."""
  m_axes = engine.axes["encoder"]["blocks"][0]
  names = {"attn": ("wq", "bq", "wk", "bk", "wv", "bv", "wo"), "mlp": ("w1", "b1", "w2")}
  specs = {g: {n: m_axes[g][n].spec() for n in ns} for g, ns in names.items()}
  head_dim = engine.unit_sizes["heads"]

  def local(plans, w, x):
    att = offload.attention_block(plans["heads"], layout.heads.widths, x,
                                  *[w["attn"][n] for n in names["attn"]], head_dim=head_dim,
                                  causal=True)
    return att + offload.mlp_block(plans["mlp"], layout.mlp.widths, x,
                                   *[w["mlp"][n] for n in names["mlp"]])

  plan_specs = {k: p.specs() for k, p in plans.items()}
  fn = jax.shard_map(local, mesh=engine.mesh, in_specs=(plan_specs, specs, P()), out_specs=P())
  loss = lambda w, plans, x: jnp.sum(fn(plans, w, x) ** 2)
  step = jax.jit(jax.value_and_grad(loss))
  return step, names


def bench_model(name, config, repeats):
  run = config_lib.validate(config, jax.device_count())
  engine = train.build_engine(run)
  n = engine.tensor_size
  a = base_layout(config, n)
  state = engine.init(0, a)
  m = config.model
  rng = np.random.default_rng(0)
  toks = rng.integers(0, m.vocab_size, (config.batch_size, m.seq_len + 1)).astype(np.int32)
  batch = engine.shard_batch({"inputs": toks[:, :-1], "targets": toks[:, 1:]})
  plan = engine.plan(a)
  holder = {"state": state}

  def step():
    holder["state"], metrics = engine.train_step(holder["state"], batch, plan)
    return metrics["loss"]

  step_s = median_s(step, repeats)
  state = holder["state"]
  mig = migrate.Migrator.for_engine(engine)
  axes = migrate.state_axes(state, engine.tx, engine.axes)
  rows = []

  def timed_move(b):
    """Median seconds of one policy-path move A -> B (timed as A -> B -> A, halved)."""
    engine.compile_moves(holder["state"], a, b)
    engine.compile_moves(engine.move(holder["state"], a, b), b, a)
    def round_trip():
      holder["state"] = engine.move(engine.move(holder["state"], a, b, donate=True), b, a,
                                    donate=True)
      return holder["state"]
    return median_s(round_trip, repeats) / 2

  total_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  x = jax.random.normal(jax.random.key(0), (config.batch_size, m.seq_len, m.d_model))
  w = {"attn": state.params["encoder"]["blocks"][0]["attn"],
       "mlp": state.params["encoder"]["blocks"][0]["mlp"]}
  none = {k: offload.no_offload(u, engine.mesh) for k, u in a.kinds().items()}
  blk, names = block_fn(engine, a, none, x)
  w = {g: {nm: w[g][nm].copy() for nm in ns} for g, ns in names.items()}   # moves donate
  block_s = median_s(lambda: blk(w, none, x), repeats)

  for share in SHARES:
    moves_by_kind = shares_moves(a, share)
    b = migrate.move_units(a, moves_by_kind)
    row = {"model": name, "share": share,
           "units": {k: len(v) for k, v in moves_by_kind.items()}}
    moves = migrate.plan(a, b, chunk="sized")
    nbytes = migrate.payload_bytes(state, axes, moves, engine.unit_sizes)
    gather = migrate.payload_bytes(state, axes, migrate.plan(a, b, chunk=None),
                                   engine.unit_sizes)["wire"]
    secs = timed_move(b)
    state = holder["state"]
    row.update({"moved_bytes": nbytes["moved"], "wire_bytes": nbytes["wire"],
                "allgather_bytes": gather, "wire_over_allgather": nbytes["wire"] / gather,
                "chunk": {k: mv.chunk for k, mv in moves.kinds.items()},
                "migrate_s": secs, "migrate_over_step": secs / step_s})
    # Offload of the same units: helpers compute them in every block, every step.
    plans = {k: offload.make_plan(
        u, {0: _per_helper(moves_by_kind[k])} if moves_by_kind[k] else {}, engine.mesh)
             for k, u in a.kinds().items()}
    blk_off, _ = block_fn(engine, a, plans, x)
    off_s = median_s(lambda: blk_off(w, plans, x), repeats)
    overhead = (off_s - block_s) * m.num_layers
    row.update({"block_s": block_s, "block_offload_s": off_s,
                "offload_overhead_over_step": overhead / step_s,
                "offload_bytes_per_step": 2 * nbytes["moved"] // 3})   # weights out, grads back
    rows.append(row)

  # An all-gather's worth (chunk = C: one executable for every pair of the bucket), once.
  full = migrate.plan(a, b, chunk=None)
  mig.compile(state, axes, full)
  mig.compile(mig(state, axes, full), axes, migrate.plan(b, a, chunk=None))
  full_s = median_s(lambda: mig(mig(state, axes, full), axes, migrate.plan(b, a, chunk=None)),
                    repeats) / 2
  full_wire = migrate.payload_bytes(state, axes, full, engine.unit_sizes)["wire"]
  # A bucket switch: device 1 receives units until its capacity must grow.
  grow = {"mlp": [(u, 1) for u in a.mlp.owned[0][: a.mlp.capacity - a.mlp.counts[1] + 1]]}
  big = migrate.move_units(a, grow, capacities={"mlp": (a.mlp.capacity, 2 * a.mlp.capacity)})
  switch = migrate.plan(a, big, chunk="sized")
  sw_s = timed_move(big)
  extra = {"model": name, "step_s": step_s, "state_bytes": total_bytes,
           "chunk_capacity": {"wire_bytes": full_wire, "seconds": full_s,
                              "over_step": full_s / step_s},
           "bucket_switch": {"capacity": [a.mlp.capacity, big.mlp.capacity],
                             "units": switch.units_moved()["mlp"],
                             "moved_bytes": migrate.payload_bytes(state, axes, switch,
                                                                  engine.unit_sizes)["moved"],
                             "wire_bytes": migrate.payload_bytes(state, axes, switch,
                                                                 engine.unit_sizes)["wire"],
                             "seconds": sw_s, "over_step": sw_s / step_s},
           "migration_compiles": mig.compile_count}
  return rows, extra


def _per_helper(pairs):
  out = {}
  for _, h in pairs:
    out[h] = out.get(h, 0) + 1
  return out


def main(argv):
  del argv
  repeats = _REPEATS.value or (3 if _QUICK.value else 7)
  all_rows, models = [], {}
  for name, config in configs(_QUICK.value).items():
    t = time.perf_counter()
    rows, extra = bench_model(name, config, repeats)
    extra["bench_seconds"] = time.perf_counter() - t
    all_rows += rows
    models[name] = extra
    print(f"{name}: done in {extra['bench_seconds']:.0f} s", flush=True)
  mib = lambda b: b / 2**20
  table = report.markdown_table(
      ["model", "share of dev 0", "units (mlp/heads)", "moved MiB", "policy-path wire MiB",
       "all-gather MiB", "wire / all-gather", "migrate s", "migrate / step",
       "offload overhead / step (every step)"],
      [[r["model"], f"{100 * r['share']:g}%", f"{r['units']['mlp']}/{r['units']['heads']}",
        mib(r["moved_bytes"]), mib(r["wire_bytes"]), mib(r["allgather_bytes"]),
        r["wire_over_allgather"], r["migrate_s"], r["migrate_over_step"],
        r["offload_overhead_over_step"]] for r in all_rows])
  table += "\n" + report.markdown_table(
      ["model", "train step s", "state MiB", "all-gather's worth (chunk=C): MiB / time over step",
       "bucket switch on the policy path: time over step (C, units, wire MiB)",
       "migration executables"],
      [[n, e["step_s"], mib(e["state_bytes"]),
        f"{mib(e['chunk_capacity']['wire_bytes']):.3g} / {e['chunk_capacity']['over_step']:.3g}",
        f"{e['bucket_switch']['over_step']:.3g} ({e['bucket_switch']['capacity'][0]}->"
        f"{e['bucket_switch']['capacity'][1]}, {e['bucket_switch']['units']}, "
        f"{mib(e['bucket_switch']['wire_bytes']):.3g})",
        e["migration_compiles"]] for n, e in models.items()])
  payload = {"backend": jax.default_backend(), "jax": jax.__version__,
             "devices": jax.device_count(), "quick": _QUICK.value, "repeats": repeats,
             "rows": all_rows, "models": models}
  paths = report.write(_OUT.value, "results", payload, table)
  print(table)
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
