r"""semijax's training step against the same model written plainly in JAX, per precision.

  python experiments/bench_peer.py --out_dir=results/bench_peer              # any backend
  python experiments/bench_peer.py --model=llama --kv_heads=4 \
      --out_dir=results/bench_peer_llama                                      # the Llama
  JAX_PLATFORMS=cuda python experiments/bench_peer.py --d_model=768 --d_ff=3072 --heads=12 \
      --layers=12 --seq_len=1024 --batch=8                                    # GPT-2 small

Times three training steps (forward, backward, AdamW) of one byte-level GPT from the same
parameters in interleaved rounds: `plain` (a `jax.jit` of a pure function, `benchmarks/
plain_gpt.py`), semijax's `even` step and its `uneven` step (device 0 owning --uneven of the
others' share, branched over --num_widths widths; on one device: every unit, through the branch),
at each --precision (float32 or bfloat16 compute, float32 master weights, float32 logits and
loss). Reports the median ms/step over --rounds rounds of --steps steps with the rounds' min and
max, model TFLOP/s and semijax / plain (`benchmarks/peer.py`). Writes --out_dir/bench_peer.
{json,md}. The default shape is small enough for a CPU; with --tensor=N the semijax steps split
over N devices and the plain step splits its batch over the same N. --model=llama times the
Llama (`benchmarks/plain_llama.py`: RMSNorm, SwiGLU with --d_ff hidden units, rotary embeddings,
--kv_heads key/value heads shared by --heads query heads; its uneven step splits KV groups).
"""

import os
import sys

from absl import app, flags
import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import peer  # noqa: E402
from benchmarks import report  # noqa: E402
from semijax.core import precision as precision_lib  # noqa: E402
from semijax.runtime import cli  # noqa: E402

_D = peer.Settings()
_OUT = flags.DEFINE_string("out_dir", "results/bench_peer", "Where to write the results.")
_PRECISION = flags.DEFINE_multi_string(
    "precision", list(_D.precision), "Compute dtypes: float32, bfloat16 (repeat the flag or give "
    "a comma-separated list).")
_ATTENTION = flags.DEFINE_enum("attention", _D.attention, list(precision_lib.ATTENTION),
                               "jax.nn.dot_product_attention's implementation (auto: cuDNN where "
                               "it applies).")
_MODEL = flags.DEFINE_enum("model", _D.model, list(peer.MODELS), "The model: the GPT or the "
                           "Llama.")
_KV_HEADS = flags.DEFINE_integer("kv_heads", _D.kv_heads, "--model=llama: key/value heads, "
                                 "dividing --heads (0: as many as --heads).")
_D_MODEL = flags.DEFINE_integer("d_model", _D.d_model, "Model width.")
_D_FF = flags.DEFINE_integer("d_ff", _D.d_ff, "MLP hidden units.")
_HEADS = flags.DEFINE_integer("heads", _D.heads, "Attention heads.")
_LAYERS = flags.DEFINE_integer("layers", _D.layers, "Transformer blocks.")
_SEQ = flags.DEFINE_integer("seq_len", _D.seq_len, "Tokens per example.")
_BATCH = flags.DEFINE_integer("batch", _D.batch, "Examples per step.")
_TENSOR = flags.DEFINE_integer("tensor", _D.tensor, "Devices on semijax's tensor axis (the plain "
                               "step splits its batch over the same devices).")
_UNEVEN = flags.DEFINE_float("uneven", _D.uneven, "The uneven step: device 0's share of each "
                             "unit kind relative to the others' (in (0, 1]).")
_WIDTHS = flags.DEFINE_integer("num_widths", _D.num_widths, "Compiled widths per kind of the "
                               "uneven (branched) step.")
_STEPS = flags.DEFINE_integer("steps", _D.steps, "Timed steps per program and round.")
_ROUNDS = flags.DEFINE_integer("rounds", _D.rounds, "Interleaved rounds.")


def settings() -> peer.Settings:
  """The flags as `peer.Settings` (not yet validated)."""
  precision = tuple(p.strip() for v in _PRECISION.value for p in v.split(",") if p.strip())
  return peer.Settings(precision=precision, attention=_ATTENTION.value, model=_MODEL.value,
                       kv_heads=_KV_HEADS.value, d_model=_D_MODEL.value,
                       d_ff=_D_FF.value, heads=_HEADS.value, layers=_LAYERS.value,
                       seq_len=_SEQ.value, batch=_BATCH.value, tensor=_TENSOR.value,
                       uneven=_UNEVEN.value, num_widths=_WIDTHS.value, steps=_STEPS.value,
                       rounds=_ROUNDS.value)


def main(argv):
  del argv
  with cli.one_line_errors():
    s = settings().validate(jax.device_count(), jax.default_backend())
  write = lambda p: report.write(_OUT.value, "bench_peer", p, peer.table(p))
  payload = peer.run(s, after_round=write)     # a run cut short keeps the rounds it finished
  table = peer.table(payload)
  paths = write(payload)
  ratios = ", ".join(f"{r['precision']}: even {r['even_over_plain']:.2f}x, uneven "
                     f"{r['uneven_over_plain']:.2f}x" for r in payload["ratios"])
  print(f"{payload['device']} ({payload['backend']}), {s.model}, tensor={s.tensor}; semijax / "
        f"plain: {ratios}\n{table}")
  print(f"wrote {paths['json']} and {paths['md']}")


if __name__ == "__main__":
  app.run(main, flags_parser=cli.parse_flags)
