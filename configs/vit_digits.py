r"""A ViT classifying scikit-learn's bundled 8x8 handwritten digits (no download).

Needs the `digits` extra (scikit-learn): pip install 'semijax[digits]'. Or train on your own
images with --config.data.name=npy --config.data.images=x.npy --config.data.labels=y.npy
(and set config.model.image_size / channels / num_classes to match).
Options after the colon: cpu (a small variant for CPUs), tensor=N, data=N.

  python experiments/train.py --config configs/vit_digits.py:cpu --workdir /tmp/vit_digits
"""

from semijax.train import config as config_lib


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, cpu=False, tensor=8, data=1)
  config = config_lib.base_config()
  config.mesh.data = arg.data
  config.mesh.tensor = arg.tensor

  # Model section: 8x8x1 images, 2x2 patches -> 16 patches + a class token.
  config.model.name = "vit"
  config.model.image_size = 8
  config.model.patch_size = 2
  config.model.channels = 1
  config.model.num_classes = 10
  config.model.d_model = 64 if arg.cpu else 256
  config.model.num_heads = 8
  config.model.d_ff = 128 if arg.cpu else 1024
  config.model.num_layers = 2 if arg.cpu else 6

  # Data section: 20% of the 1,797 digits held out for validation.
  config.data.name = "digits"
  config.data.val_fraction = 0.2

  # Training section.
  config.steps = 200 if arg.cpu else 3_000
  config.batch_size = 32 if arg.cpu else 128
  config.eval_every = 50 if arg.cpu else 500
  config.log_every = 10 if arg.cpu else 50
  config.checkpoint_every = 100 if arg.cpu else 1_000
  config.optimizer.learning_rate = 3e-3 if arg.cpu else 1e-3
  config.optimizer.warmup_steps = 20 if arg.cpu else 200
  return config
