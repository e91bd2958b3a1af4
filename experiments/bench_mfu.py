r"""Model-FLOPs utilization of a training step on one device, at every compiled bucket width.

  python experiments/bench_mfu.py --model=bench --out_dir=results/bench_mfu       # any backend
  JAX_PLATFORMS=cuda python experiments/bench_mfu.py --model=gpt_tiny             # on a GPU

The engine's training step (forward, backward, AdamW) of a GPT on a single device (tensor = 1)
that computes w of its units in every block, at each bucket width w, in two programs: the
single-width step (compiled for w alone) and the branched step that an uneven split runs, with
each width kernel of `--kernels` (`layout.kernel`: "switch", a `lax.switch` over every width;
"pallas", one program whose GEMMs skip the units past w). Reports seconds per step, the model
FLOPs of the units computed (`benchmarks.mfu.step_flops`), the achieved TFLOP/s and the MFU
against the device's peak for its compute dtype (`--peak_tflops`, or the table in
benchmarks/mfu.py for known GPUs). Models: `bench`, the straggler benchmark's (d_model 256,
d_ff 1024, 2 layers, batch 16 x 64 tokens), and `gpt_tiny`,
configs/gpt_tiny.py's default GPU size (d_model 512, d_ff 2048, 6 layers, batch 64 x 256, in
bfloat16; the others in float32). `--dtype` sets the compute dtype of either. Every
(width, program) cell runs `--steps` steps once per round, in `--rounds` interleaved rounds;
the branched step's cost over the single-width one is taken round by round. Writes
--out_dir/bench_mfu.{json,md}, rewritten after every round.
"""

import os
import sys

from absl import app, flags
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import mfu  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.core import mesh as mesh_lib  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.train import config as config_lib  # noqa: E402
from semijax.train import data as data_lib  # noqa: E402
from semijax.train import loop as train  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "results/bench_mfu", "Where to write the results.")
_MODEL = flags.DEFINE_enum("model", "bench", ["bench", "gpt_tiny", "tiny"],
                           "bench: the straggler benchmark's model; gpt_tiny: the GPU default; "
                           "tiny: a few-second smoke test.")
_WIDTHS = flags.DEFINE_integer("num_widths", 6, "Compiled bucket widths per kind.")
_STEPS = flags.DEFINE_integer("steps", 10, "Timed steps per program and round (their median "
                              "is the round's figure).")
_ROUNDS = flags.DEFINE_integer("rounds", 3, "Interleaved rounds.")
_KERNELS = flags.DEFINE_list("kernels", ["switch", "pallas"],
                             "Width kernels of the branched step (layout.kernel).")
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "The device's peak TFLOP/s (0: look it up).")
_DTYPE = flags.DEFINE_enum("dtype", "", ["", "float32", "bfloat16", "float16"],
                           "Compute dtype (model.dtype); '' = the model's config.")


def model_config(name: str, num_widths: int, dtype: str = ""):
  """The config of model `name` on one device, computing in `dtype` ("": the config's)."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  arg = "tensor=1" if name == "gpt_tiny" else "cpu,tensor=1"
  c = config_lib.load(os.path.join(root, "configs", "gpt_tiny.py") + ":" + arg)
  if name == "bench":
    c.model.d_model, c.model.d_ff, c.model.num_layers, c.batch_size = 256, 1024, 2, 16
  elif name == "tiny":
    c.model.d_model, c.model.d_ff, c.model.num_layers, c.batch_size = 64, 128, 1, 4
    c.model.num_heads, c.model.seq_len = 4, 16
  c.layout.num_widths = num_widths
  if dtype:
    c.model.dtype = dtype
  return c


def main(argv):
  del argv
  bad = [k for k in _KERNELS.value if k not in ("switch", "pallas")]
  if bad:
    raise app.UsageError(f"--kernels: unknown {bad}; choose from ['switch', 'pallas']")
  for flag in (_STEPS, _ROUNDS):
    if flag.value < 1:
      raise app.UsageError(f"--{flag.name}: must be at least 1, got {flag.value}")
  run = config_lib.validate(model_config(_MODEL.value, _WIDTHS.value, _DTYPE.value),
                            jax.device_count(), jax.process_count())
  if run.mesh.tensor != 1 or run.mesh.data != 1:
    raise app.UsageError("bench_mfu runs on one device")
  engine = train.build_engine(run)
  dataset = data_lib.build(run.data, *mesh_lib.batch_feed(engine.mesh))
  batch = engine.shard_batch(dataset.train_batch(0))
  device = jax.devices()[0]
  dtype = run.model.precision.dtype
  peak = mfu.peak_tflops(device.device_kind, _PEAK.value, dtype)
  tokens = run.batch_size * run.model.seq_len
  vocab = run.model.kwargs["vocab_size"]
  capacity = {"mlp": run.layout.mlp.capacity, "heads": run.layout.heads.capacity}
  flops_of = lambda w: mfu.step_flops(run.model, w, tokens, vocab)

  def payload(widths, figures):
    rows = mfu.results(widths, figures, flops_of, peak)
    return {"model": _MODEL.value, "spec": run.model.to_dict(), "batch_size": run.batch_size,
            "backend": jax.default_backend(), "device": device.device_kind,
            "jax": jax.__version__, "dtype": dtype, "peak_tflops": peak,
            "matmul_precision": str(jax.config.jax_default_matmul_precision),
            "kernels": _KERNELS.value, "steps": _STEPS.value,
            "rounds_done": min(len(v) for v in figures.values()), "widths": rows}

  def write(widths, figures):      # after every round: a run cut short keeps its rounds
    p = payload(widths, figures)
    return p, report.write(_OUT.value, "bench_mfu", p,
                           mfu.table(p["widths"], capacity, _KERNELS.value))
  state = engine.init(run.seed, run.layout)
  widths, figures = mfu.measure(engine, state, batch, run.layout, _KERNELS.value, _STEPS.value,
                                _ROUNDS.value, after_round=write)
  p, paths = write(widths, figures)
  print(f"{device.device_kind} ({jax.default_backend()}), {dtype}, peak {peak} TFLOP/s, "
        f"{p['rounds_done']} rounds\n{mfu.table(p['widths'], capacity, _KERNELS.value)}")
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
