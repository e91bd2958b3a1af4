r"""A small GPT on text that ships with Python (no download).

Default: a model sized for one GPU or TPU host, on the standard library's .py sources (about
12 MB) tokenized by a 4,096-token byte-level BPE (data.name "tokens"; about 3.5M tokens), which
one command prepares from the repository root (a few seconds; docs/data.md):

  python experiments/prepare_data.py --input=stdlib --out_dir=data/stdlib_bpe4k --vocab_size=4096

Options after the colon:
  cpu         a small byte-level variant for CPUs (8 fake devices on 2 cores train it in
              minutes), on the pydoc help topics (about 0.5 MB; data.name "pydoc")
  tensor=N    devices on the tensor axis; data=N: data-parallel replicas

  python experiments/train.py --config configs/gpt_tiny.py:cpu --workdir /tmp/gpt_tiny
  python experiments/train.py --config configs/gpt_tiny.py:cpu --workdir /tmp/gpt_slow \
      --config.hetero.slowdown='(1,1,1,4,1,1,1,1)' --config.layout.mlp=56,56,56,16,56,56,56,60
"""

from semijax.train import config as config_lib
from semijax.train import prepare


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, cpu=False, tensor=8, data=1)
  config = config_lib.base_config()
  config.mesh.data = arg.data
  config.mesh.tensor = arg.tensor

  # Model section: a causal transformer; the CPU variant is byte-level (the 256 byte values),
  # the default's vocabulary is its token shards' (4,096).
  config.model.name = "gpt"
  config.model.vocab_size = 256 if arg.cpu else prepare.STDLIB_VOCAB
  config.model.seq_len = 64 if arg.cpu else 256
  config.model.d_model = 128 if arg.cpu else 512
  config.model.num_heads = 16        # >= mesh.tensor, so every device can own a head
  config.model.d_ff = 512 if arg.cpu else 2048
  config.model.num_layers = 2 if arg.cpu else 6
  # Accelerators compute in bfloat16 (float32 master weights); the CPU variant stays float32.
  config.model.dtype = "float32" if arg.cpu else "bfloat16"

  # Data section. CPU: the pydoc topics' bytes, the last 10% held out. Default: the tokenized
  # standard library (train_*.bin; its last 10% of tokens in val_*.bin, of which the 4
  # validation batches take 66k tokens).
  config.data.val_fraction = 0.1
  config.data.eval_batches = 4
  if arg.cpu:
    config.data.name = "pydoc"
  else:   # data.name "tokens", data.path and data.val_path: data/stdlib_bpe4k/{train,val}_*.bin
    prepare.use_shards(config, prepare.STDLIB_DIR, prepare.STDLIB_VOCAB)

  # Training section.
  config.steps = 150 if arg.cpu else 5_000
  config.batch_size = 16 if arg.cpu else 64
  config.eval_every = 50 if arg.cpu else 500
  config.log_every = 10 if arg.cpu else 50
  config.checkpoint_every = 50 if arg.cpu else 1_000
  config.optimizer.learning_rate = 3e-3 if arg.cpu else 1e-3
  config.optimizer.warmup_steps = 20 if arg.cpu else 200
  return config
