r"""HarmonyTrain's scenario: a byte-level GPT of 8 layers on 8 emulated devices in two regions.

Devices 0-3 (region 0) run at speed 1, devices 4-7 (region 1) at speed 0.5; links inside a
region have 0.1 ms latency and 200 MB/s, links between the regions 10 ms and 2 MB/s (100x
slower). The devices' compute and the links are emulated (`core.emulation.PipelineEmulator`) at
`hetero.device_gflops` = 0.2 GFLOP/s per unit of speed, low enough that the emulated time, not
this machine's real compute, dominates a step. As written the config runs an even pipeline (2
stages of 4 tensor devices, one per region); `--config.plan=auto` lets the planner choose:

  python experiments/train.py --config configs/gpt_harmony.py --workdir /tmp/harmony \
      --config.plan=auto
  python experiments/plan.py --config configs/gpt_harmony.py --baselines   # the plan alone

Options after the colon: layers=N (model.num_layers).
"""

from semijax.train import config as config_lib


def get_config(arg=None):
  arg = config_lib.parse_arg(arg, layers=8)
  config = config_lib.base_config()

  # Model section: gpt_tiny's byte-level GPT, narrower and deeper.
  config.model.name = "gpt"
  config.model.vocab_size = 256
  config.model.seq_len = 64
  config.model.d_model = 64
  config.model.num_heads = 16
  config.model.d_ff = 256
  config.model.num_layers = arg.layers
  config.data.name = "pydoc"
  config.data.eval_batches = 4

  # Devices, links and the pipeline (replaced by the plan with --config.plan=auto).
  config.mesh.data, config.mesh.pipe, config.mesh.tensor = 1, 2, 4
  config.pipeline.microbatches = 8
  config.hetero.device_gflops = 0.2
  config.hetero.device_speeds = (1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5)
  config.hetero.links.regions = (0, 0, 0, 0, 1, 1, 1, 1)
  config.hetero.links.latency_s = (1e-4, 1e-2)     # inside a region, between regions
  config.hetero.links.bandwidth = (2e8, 2e6)       # bytes/s

  # Training section.
  config.steps = 60
  config.batch_size = 16
  config.eval_every = 10
  config.log_every = 5
  config.checkpoint_every = 30
  config.optimizer.learning_rate = 3e-3
  config.optimizer.warmup_steps = 10
  return config
