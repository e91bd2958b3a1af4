r"""The speed probe on the device it runs on: its cost per sample, and the MFU the metrics show.

  JAX_PLATFORMS=cuda python experiments/bench_probe.py --out_dir=results/bench_probe   # a GPU
  python experiments/bench_probe.py --model=tiny --steps=12 --out_dir=/tmp/probe        # CPU

Trains configs/gpt_tiny.py (its GPU size; `tiny`: a few-second model) on the devices of this
process (`--tensor`, default all) with `balance.policy=semi` measuring speeds by
`balance.measure=probe` (the model's MLP block on every device at once, every `--probe_every`
steps), then reads the run's decisions and metrics (`benchmarks.probe_cost`). Writes
--out_dir/bench_probe.{json,md} and the run's workdir (--out_dir/run).
"""

import os
import shutil
import sys

from absl import app, flags
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import probe_cost  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.runtime import cli  # noqa: E402
from semijax.train import config as config_lib  # noqa: E402
from semijax.train import loop as train  # noqa: E402

_OUT = flags.DEFINE_string("out_dir", "results/bench_probe", "Where to write the results.")
_MODEL = flags.DEFINE_enum("model", "gpt_tiny", ["gpt_tiny", "tiny"],
                           "gpt_tiny: configs/gpt_tiny.py's GPU size; tiny: a smoke test.")
_STEPS = flags.DEFINE_integer("steps", 60, "Training steps.", lower_bound=8)
_EVERY = flags.DEFINE_integer("probe_every", 4, "Steps between probe samples.", lower_bound=1)
_TENSOR = flags.DEFINE_integer("tensor", 0, "Tensor devices (0: every local device).",
                               lower_bound=0)
_PEAK = flags.DEFINE_float("peak_tflops", 0.0, "One device's peak TFLOP/s (0: the table's).")


def run_config(model: str, steps: int, probe_every: int, tensor: int, peak_tflops: float):
  """gpt_tiny for the probe run: semi measuring by probe, no checkpoints but the last."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  arg = f"tensor={tensor}" + (",cpu" if model == "tiny" else "")
  c = config_lib.load(os.path.join(root, "configs", "gpt_tiny.py") + ":" + arg)
  if model == "gpt_tiny":   # byte-level text that ships with Python: no prepared token shards
    # (an offline accelerator host may lack the `tokenizers` package that prepares them)
    c.data.name, c.data.path, c.data.val_path, c.model.vocab_size = "stdlib", "", "", 256
  if model == "tiny":
    c.model.d_model, c.model.d_ff, c.model.num_layers, c.batch_size = 64, 128, 1, 8
    c.model.num_heads, c.model.seq_len = 4, 16
  c.steps, c.eval_every, c.log_every = steps, steps, max(1, steps // 10)
  c.checkpoint_every, c.keep_checkpoints = 0, 1
  c.balance.policy, c.balance.measure, c.balance.probe_every = "semi", "probe", probe_every
  c.profile.peak_tflops = peak_tflops
  return c


def main(argv):
  del argv
  tensor = _TENSOR.value or jax.local_device_count()
  config = run_config(_MODEL.value, _STEPS.value, _EVERY.value, tensor, _PEAK.value)
  workdir = os.path.join(_OUT.value, "run")
  shutil.rmtree(workdir, ignore_errors=True)
  summary = train.train_and_evaluate(config, workdir)
  out = probe_cost.summarize(workdir, _EVERY.value)
  passes = summary["balance"].get("probe_passes")
  device = jax.devices()[0]
  median = {k: None if out[k] is None else out[k]["median"]
            for k in ("sample_s", "step_s", "mfu", "tflops_per_device")}
  ms = {k: None if median[k] is None else 1e3 * median[k] for k in ("sample_s", "step_s")}
  table = report.markdown_table(
      ["device", "tensor", "dtype", "passes", "probe ms / sample", "step ms", "probe / step",
       "amortized", "MFU", "TFLOP/s per device"],
      [[device.device_kind, tensor, config.model.dtype, passes, report.fmt(ms["sample_s"], ".2f"),
        report.fmt(ms["step_s"], ".1f"), report.fmt(out["sample_share_of_step"], ".1%"),
        report.fmt(out["amortized_share"], ".2%"), report.fmt(median["mfu"], ".1%"),
        report.fmt(median["tflops_per_device"], ".3f")]])
  payload = dict(out, model=_MODEL.value, steps=_STEPS.value, probe_every=_EVERY.value,
                 probe_passes=passes,
                 tensor=tensor, backend=jax.default_backend(), device=device.device_kind,
                 jax=jax.__version__, dtype=config.model.dtype)
  paths = report.write(_OUT.value, "bench_probe", payload, table)
  print(f"{table}\nwrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
