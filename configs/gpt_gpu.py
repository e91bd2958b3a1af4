r"""A GPT-2-small-shaped GPT for one GPU, on the tokenized standard library (no download).

d_model 768, 12 layers, 12 heads, d_ff 3072, 1,024 tokens x 16 a step, bfloat16 compute with
float32 master weights (docs/performance.md#on-a-gpu: bfloat16 GEMMs on the tensor cores and
cuDNN's fused attention, which never holds the [batch, heads, seq, seq] scores), on the standard
library's .py sources tokenized by a 4,096-token byte-level BPE (about 3.1M training tokens: a
step takes 16k, so 2,000 steps are about 10 passes). Prepare the data once, from the repository
root (a few seconds; docs/data.md), then train:

  python experiments/prepare_data.py --input=stdlib --out_dir=data/stdlib_bpe4k --vocab_size=4096
  python experiments/train.py --config configs/gpt_gpu.py --workdir /tmp/gpt_gpu

Options after the colon: tensor=N (devices on the tensor axis, up to the 12 heads; default 1),
data=N (data-parallel replicas; default 1).
"""

from semijax.train import config as config_lib
from semijax.train import prepare


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, tensor=1, data=1)
  config = config_lib.base_config()
  config.mesh.data = arg.data
  config.mesh.tensor = arg.tensor

  # Model section: GPT-2 small's shape with a 4,096-token vocabulary (its token shards').
  config.model.name = "gpt"
  config.model.vocab_size = prepare.STDLIB_VOCAB
  config.model.seq_len = 1024
  config.model.d_model = 768
  config.model.num_heads = 12        # head_dim 64, which cuDNN's fused attention takes
  config.model.d_ff = 3072
  config.model.num_layers = 12
  config.model.dtype = "bfloat16"

  # Data section: data/stdlib_bpe4k/{train,val}_*.bin (the last 10% of the tokens validate; the
  # 4 validation batches take 66k of its 348k tokens).
  prepare.use_shards(config, prepare.STDLIB_DIR, prepare.STDLIB_VOCAB)
  config.data.eval_batches = 4

  # Training section: 16 sequences of 1,024 tokens a step, at GPT-2 small's learning rate.
  config.steps = 2_000
  config.batch_size = 16
  config.optimizer.learning_rate = 6e-4
  config.optimizer.warmup_steps = 100
  # A validation pass every 200 steps, a record every 20, a checkpoint every 500.
  config.eval_every = 200
  config.log_every = 20
  config.checkpoint_every = 500
  return config
