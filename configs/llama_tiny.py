r"""A small Llama-style model (RMSNorm, SwiGLU, rotary embeddings, grouped-query attention) on
text that ships with Python (no download).

Its "heads" units are KV groups (a key/value head and the query heads that share it):
`layout.heads` counts model.num_kv_heads of them, so a device never splits a group.

Default: a model for one GPU (GPT-2 small's width and depth, 12 query heads in 4 KV groups,
SwiGLU's hidden size 2,048 ~ 8/3 d_model), 1,024 tokens x 16 a step in bfloat16 compute with
float32 master weights, on the standard library's .py sources tokenized by a 4,096-token
byte-level BPE, which one command prepares from the repository root (a few seconds;
docs/data.md):

  python experiments/prepare_data.py --input=stdlib --out_dir=data/stdlib_bpe4k --vocab_size=4096
  python experiments/train.py --config configs/llama_tiny.py --workdir /tmp/llama

Options after the colon:
  cpu         a small byte-level variant for CPUs (about the parameters of gpt_tiny:cpu; 8 fake
              devices on 2 cores train it in minutes), on the pydoc help topics (data.name
              "pydoc"); 16 query heads in 8 KV groups, one per device of the default tensor=8
  tensor=N    devices on the tensor axis (default 8 with cpu, else 1); data=N: replicas

  python experiments/train.py --config configs/llama_tiny.py:cpu --workdir /tmp/llama_tiny
  python experiments/train.py --config configs/llama_tiny.py:cpu --workdir /tmp/llama_slow \
      --config.hetero.slowdown='(1,1,1,4,1,1,1,1)' --config.layout.heads=1,1,1,0,1,1,1,2
"""

from semijax.train import config as config_lib
from semijax.train import prepare


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, cpu=False, tensor=0, data=1)
  config = config_lib.base_config()
  config.mesh.data = arg.data
  config.mesh.tensor = arg.tensor or (8 if arg.cpu else 1)

  # Model section: a causal Llama; the CPU variant is byte-level (the 256 byte values), the
  # default's vocabulary is its token shards' (4,096).
  config.model.name = "llama"
  config.model.vocab_size = 256 if arg.cpu else prepare.STDLIB_VOCAB
  config.model.seq_len = 64 if arg.cpu else 1024
  config.model.d_model = 128 if arg.cpu else 768
  config.model.num_heads = 16 if arg.cpu else 12      # head_dim 8; 64 (cuDNN's fused attention)
  config.model.num_kv_heads = 8 if arg.cpu else 4     # the "heads" units: KV groups
  config.model.d_ff = 344 if arg.cpu else 2048        # ~ 8/3 d_model: SwiGLU has 3 matrices
  config.model.num_layers = 2 if arg.cpu else 12
  config.model.tie_embeddings = False
  config.model.dtype = "float32" if arg.cpu else "bfloat16"

  # Data section. CPU: the pydoc topics' bytes, the last 10% held out. Default: the tokenized
  # standard library (train_*.bin; the last 10% of its tokens in val_*.bin).
  config.data.val_fraction = 0.1
  config.data.eval_batches = 4
  if arg.cpu:
    config.data.name = "pydoc"
  else:   # data.name "tokens", data.path and data.val_path: data/stdlib_bpe4k/{train,val}_*.bin
    prepare.use_shards(config, prepare.STDLIB_DIR, prepare.STDLIB_VOCAB)

  # Training section.
  config.steps = 150 if arg.cpu else 2_000
  config.batch_size = 16
  config.eval_every = 50 if arg.cpu else 250
  config.log_every = 10 if arg.cpu else 50
  config.checkpoint_every = 50 if arg.cpu else 500
  config.optimizer.learning_rate = 3e-3 if arg.cpu else 6e-4
  config.optimizer.warmup_steps = 20 if arg.cpu else 200
  return config
