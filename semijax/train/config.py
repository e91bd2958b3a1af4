"""Configuration: the shared defaults every config file extends, and the typed run config.

Config files in `configs/` start from `base_config()` and define `get_config(arg)`; `load` reads
one like `--config` does. The entry point hands the ConfigDict to `validate`, which checks it
whole before anything is compiled or loaded and turns it into a frozen `RunConfig`: the one
boundary where the raw ConfigDict is read. Below it, every layer gets its own typed part
(`core.mesh.MeshSpec`, `core.layout.Layout`, `core.spec.ModelSpec`, `core.emulation.Hetero`,
`balance.resize.ResizeSpec`, `balance.settings.BalanceSettings`, `train.optimizer.OptimizerSpec`,
`train.data.DataSpec`). Every error is a `ConfigError` whose message starts with the field
("config.hetero.slowdown: ..."), says what is wrong and what is allowed. docs/config.md lists every
public field.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import numbers
import os

import jax
import ml_collections
import numpy as np

from semijax import models
from semijax.balance import policies as policies_lib
from semijax.balance import resize as resize_spec_lib
from semijax.balance import settings as settings_lib
from semijax.core import emulation
from semijax.core import layout as layout_lib
from semijax.core import mesh as mesh_lib
from semijax.core import remat
from semijax.core import resize as resize_lib
from semijax.core import schedule as schedule_lib
from semijax.core import spec as spec_lib
from semijax.core import width_gemm
from semijax.errors import ConfigError
from semijax.errors import LayoutError
from semijax.sync import settings as sync_settings_lib
from semijax.train import data as data_lib
from semijax.train import optimizer as optimizer_lib
from semijax.train import profile as profile_lib


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by every config; config files override what they need."""
  c = ml_collections.ConfigDict()
  c.seed = 0                       # Initialization and data order.
  c.steps = 200                    # Optimizer steps in total (a resumed run continues to this).
  c.batch_size = 16                # Global batch (split over mesh.data and processes).
  c.gradient_accumulation_steps = 1   # Microbatches a step runs in sequence before its update.
  c.eval_every = 50                # Steps between validation passes (and at the last step).
  c.log_every = 10                 # Steps between metric lines / progress reports.
  c.checkpoint_every = 100         # Steps between checkpoints (and at the last step); 0 = end only.
  c.keep_checkpoints = 2           # Checkpoints kept in workdir/checkpoints.
  c.run_ahead = True               # Steps run ahead of the host between records (False: wait
                                   # for every step, batches made in the loop; to debug).

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1                  # Data-parallel replicas (batch split).
  c.mesh.tensor = 8                # Tensor-parallel devices (uneven units).
  c.mesh.pipe = 1                  # Pipeline stages between them (core.pipeline); 1 = none.

  # Pipelined runs (mesh.pipe > 1 or a plan): PatchPipe (semijax.core.pipeline).
  c.pipeline = ml_collections.ConfigDict()
  c.pipeline.schedule = "1f1b"     # gpipe | 1f1b
  # Microbatches of each data-parallel pipeline: one count for all, or one per pipeline ("3,1":
  # the first takes three quarters of the global batch). Microbatches are equal in size.
  c.pipeline.microbatches = ml_collections.FieldReference(1, field_type=object)
  # Layers per stage: "even" or counts ("3,5"), in stage order.
  c.pipeline.layers = ml_collections.FieldReference("even", field_type=object)
  c.pipeline.layer_capacity = 0    # Layer slots compiled per stage; 0 = the most any stage holds.
  # Microbatches compiled per pipeline; 0 = the most any pipeline runs (balance.policy "semi"
  # with mesh.data > 1: room to re-split the batch between pipelines, see pipeline_setup).
  c.pipeline.microbatch_capacity = 0
  # With mesh.pipe > 1, layout.mlp / layout.heads give either one count per tensor device (every
  # stage alike) or pipe x tensor counts, stage by stage.

  # The partition and placement planner (semijax.planner): "" = the mesh, pipeline and layout
  # above; "auto" = plan over all devices from the model, hetero.device_speeds and hetero.links
  # (experiments/plan.py prints it); or the path of a plan's JSON (experiments/plan.py --out).
  c.plan = ""
  c.planner = ml_collections.ConfigDict()
  # Examples per microbatch to choose from ("2,4" or a tuple); () = every divisor of batch_size.
  c.planner.microbatch_sizes = ml_collections.FieldReference((), field_type=object)
  c.planner.schedules = ("gpipe", "1f1b")
  # Data-parallel sync modes the planner chooses among ("sync,ssaw" or a tuple); () = the one
  # of sync.mode. The run then combines its pipelines as the plan says (config.sync's settings).
  c.planner.syncs = ml_collections.FieldReference((), field_type=object)

  c.layout = ml_collections.ConfigDict()
  # "even" or owned units per tensor device: a tuple, or "30,30,8,30" (typed `object` so that
  # both a string and a tuple can be assigned, in Python or with --config.layout.mlp=...).
  c.layout.mlp = ml_collections.FieldReference("even", field_type=object)     # MLP units
  c.layout.heads = ml_collections.FieldReference("even", field_type=object)   # attention heads
  c.layout.num_widths = 4          # Compute widths compiled per unit kind.
  # How a device computes its width when several are compiled: "switch" (lax.switch over them),
  # "pallas" (GEMMs that skip the units past its width, one program; core.width_gemm) or
  # "auto" (pallas on GPU and TPU, switch on CPU).
  c.layout.kernel = "auto"

  c.hetero = ml_collections.ConfigDict()
  c.hetero.slowdown = ()           # Per tensor device slowdown factors; () = no emulation.
  c.hetero.device_gflops = 2.0     # Emulated FLOP rate of a nominal device (GFLOP/s).
  c.hetero.rotate_every = 0        # Steps between shifts of the slowdown profile by one device
                                   # ((8,1,...,1) rotating = the authors' dynamic
                                   # straggler); 0 = static.
  c.hetero.repeated = True         # Also emulate the work every tensor device repeats (the
                                   # head and loss on the slowest device that runs them).
  c.hetero.replica_slowdown = ()   # Per data replica slowdown factors (x its tensor group's
                                   # emulated time); () = none. A sync step waits for the slowest.
  # Pipelined and planned runs: emulated devices and links (core.emulation.PipelineEmulator).
  # Relative speed of every device, by device id ("1,1,.5,.5" or a tuple); () = none.
  c.hetero.device_speeds = ml_collections.FieldReference((), field_type=object)
  c.hetero.device_memory_gb = 0.0  # Memory of every device for the planner; 0 = unbounded.
  c.hetero.links = ml_collections.ConfigDict()
  # Region of every device, by id ("0,0,1,1" or a tuple); () = all in region 0.
  c.hetero.links.regions = ml_collections.FieldReference((), field_type=object)
  # Region-to-region links: R x R values row by row, or (inside, between) for every region pair;
  # the diagonal is the link inside a region. () = latency 0 / unbounded bandwidth.
  c.hetero.links.latency_s = ml_collections.FieldReference((), field_type=object)
  c.hetero.links.bandwidth = ml_collections.FieldReference((), field_type=object)    # bytes/s

  # Balancing (semijax.balance; BalanceSettings documents every field): who computes how much.
  c.balance = ml_collections.ConfigDict()
  c.balance.policy = "static"      # even | static | resize | migrate | offload | semi
  # Speeds from: "emulated" (the hetero.slowdown profile), "sched" (Linux scheduler stats: the
  # CPU share each process gets; CPU devices only), "probe" (timing the model's MLP block on
  # every device at once); "auto": emulated if hetero.slowdown is set, else sched on CPU
  # devices where available, else probe.
  c.balance.measure = "auto"
  c.balance.capacity_factor = 2.0  # dynamic policies: bucket capacity = factor x the even share
  c.balance.num_widths = 0         # compute widths in that bucket; 0 = layout.num_widths
  c.balance.drain = True           # migrate / semi may move every unit off a too-slow device
  c.balance.probe_every = 4        # steps between speed samples (and decisions)
  c.balance.probe_size = 0         # probe: 0 = the model's MLP block; else [size, size] matmuls
  c.balance.probe_repeats = 0      # probe passes in a row; 0 = as many as fit probe_budget
  c.balance.probe_budget = 0.03    # ... the probe's share of the time between samples
  c.balance.probe_window = 3       # probe speeds: median of the last this many samples
  c.balance.speed_alpha = 0.3      # weight of a new speed sample in a regime's smoothed speeds
  c.balance.change_threshold = 0.2 # a speed change by this factor is a candidate new regime ...
  c.balance.confirm = 2            # ... once it lasts this many samples (shorter: a burst)
  c.balance.hysteresis = 0.05      # a change must be predicted this much faster ...
  c.balance.patience = 2           # ... in this many decisions in a row
  c.balance.min_dwell_steps = 5    # steps between migrations at least
  c.balance.slow_threshold = 0.85  # relative speed below which a device counts as slow
  c.balance.resize_budget = 0.5    # semi: the largest share of a device's units it may skip
  c.balance.resize_keep = 0.5      # resize policy: keep ratio of a slow device (the authors')
  c.balance.resize_penalty = 0.05  # accuracy cost of resizing, as a share of step time
  c.balance.resize_horizon_steps = 0  # semi also resizes slowdowns expected to end within this
  c.balance.skip_budget = 0.02     # semi: skipped units x steps <= this share of those run so far
  c.balance.keep_grid = 8          # semi picks keep ratios on a grid of 1/keep_grid
  c.balance.fixed_fraction = 0.1   # cost model prior: share of a step that no split changes
  c.balance.repeat_share = 0.0     # cost model prior: work each device repeats at its own speed
  c.balance.fit_repeat = True      # cost model: may its fit replace repeat_share (False: hold it)
  c.balance.cost_alpha = 0.3       # cost model: weight of a new step time before the fit holds
  c.balance.cost_memory = 10.0     # cost model: samples its fit remembers (older ones fade)

  # ZERO-resizing (semijax.balance.resize, semijax.core.resize): who skips part of its units, how.
  c.resize = ml_collections.ConfigDict()
  c.resize.keep = ()               # One keep ratio in (0, 1] per tensor device; () = none.
  # "rotate" (the straggler is device epoch mod N), device indices like (3,) or "3,5"; "" = none.
  c.resize.straggler = ml_collections.FieldReference("", field_type=object)
  c.resize.straggler_keep = 0.5    # Keep ratio of a straggler.
  c.resize.mode = "units"          # "units" | "contraction" (the authors' variant).
  c.resize.imputation = "zero"     # "zero" | "fill" | "rescale".
  c.resize.priority = "weight_delta"   # "weight_delta" | "random" | "window" | "magnitude".
  c.resize.freeze = True           # Skipped weights and their optimizer moments stay unchanged.
  c.resize.fill_value = 1e-18      # The "fill" imputation's constant (the authors').
  c.resize.epoch_steps = 0         # Steps per rotation "epoch"; 0 = one pass over the data.
  c.resize.refresh_every = 0       # Steps between priority refreshes; 0 = epoch_steps.
  c.resize.fractions = resize_lib.DEFAULT_FRACTIONS   # contraction: compiled keep fractions.

  # Data-parallel synchronization (semijax.sync; SyncSettings documents every field).
  c.sync = ml_collections.ConfigDict()
  c.sync.mode = "sync"             # sync | ssaw | async | local_sgd
  c.sync.staleness_bound = 4       # ssaw, async: a gradient is applied at most this many
                                   # updates after the version it was computed on
  c.sync.grace = 0.25              # ssaw: a round also waits for replicas within (1 + grace) x
                                   # the first fresh arrival's compute time
  c.sync.weighting = "poly"        # ssaw: weight = samples x (1 + staleness)^-staleness_power
                                   # ("poly"), x staleness_decay^staleness ("exp"), or samples
                                   # alone ("samples")
  c.sync.staleness_power = 1.0
  c.sync.staleness_decay = 0.5
  c.sync.lr_batch_power = 0.0      # ssaw: lr x (weights / batch_size)^power (0.5: Adam's
                                   # square-root rule; 0: every round a full step)
  c.sync.local_steps = 8           # local_sgd: local steps between averages (H)
  c.sync.outer = "average"         # local_sgd: "average" or "nesterov" (DiLoCo's outer optimizer)
  c.sync.outer_lr = 0.7            # ... its learning rate
  c.sync.outer_momentum = 0.9      # ... and momentum

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 20
  c.optimizer.weight_decay = 0.1
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.grad_clip = 1.0      # Global gradient-norm clip; 0 = none.
  c.optimizer.schedule_steps = 0   # Steps of the learning-rate schedule; 0 = steps (longer runs
                                   # go on at the final rate).
  c.optimizer.mu_dtype = ""        # Adam's first moment: "" = the parameters' dtype, or bfloat16.
  c.optimizer.loss_scale = "auto"  # auto | none | dynamic (auto: dynamic where model.dtype is
                                   # float16; core.loss_scale).
  c.optimizer.loss_scale_init = 2.0 ** 15   # The first loss scale (a power of two).
  c.optimizer.loss_scale_period = 2000      # Finite steps in a row before the scale doubles.

  # name + the fields of models.REGISTRY[name].FIELDS, and the precision (core.precision):
  c.model = ml_collections.ConfigDict()
  c.model.dtype = "float32"        # Compute: activations, GEMMs, the tensor all-reduce.
  c.model.param_dtype = "float32"  # Storage: the master weights the optimizer updates.
  c.model.attention = "auto"       # xla | cudnn | auto (cuDNN on a CUDA GPU in bf16/fp16).
  c.model.remat_policy = "none"    # none | full | minimal: activations a step keeps (core.remat).
  c.data = ml_collections.ConfigDict()
  c.data.name = ""                 # gpt: "pydoc" | "stdlib" | "text_file" | "tokens";
                                   # vit: "digits" | "npy".
  c.data.path = ""                 # text_file: a UTF-8 or binary file of training text;
                                   # tokens: a path or glob of token shards (train.tokens).
  c.data.val_path = ""             # tokens: validation shards; "" = the last val_fraction.
  c.data.images = ""               # npy: images [N, H, W(, C)].
  c.data.labels = ""               # npy: int labels [N].
  c.data.val_fraction = 0.1        # Held-out share for validation.
  c.data.eval_batches = 4          # gpt: validation batches per evaluation.

  # Performance accounting (semijax.train.profile): a jax.profiler trace into the workdir's
  # TensorBoard directory, and the MFU every step's record gets.
  c.profile = ml_collections.ConfigDict()
  c.profile.start_step = 0         # The first step traced (1-based); 0 = no trace.
  c.profile.num_steps = 3          # Steps traced from there.
  c.profile.peak_tflops = 0.0      # One device's peak for MFU; 0 = the table's for its kind.
  return c


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses a config-file argument like "cpu,tensor=4" over typed `defaults`.

  A bare name sets a bool default to True; `key=value` converts value to the default's type.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    if key not in defaults:
      raise ConfigError(f"config argument: unknown option {key!r} after the colon; this config "
                        f"file's options are {sorted(defaults)}")
    kind = type(defaults[key])
    if kind is bool:
      out[key] = value.lower() not in ("0", "false", "no") if value else True
      continue
    try:
      out[key] = kind(value)
    except ValueError:
      raise ConfigError(f"config argument: option {key}={value!r} is not a "
                        f"{kind.__name__}") from None
  return out


def load(spec: str) -> ml_collections.ConfigDict:
  """Loads "path/to/config.py[:arg]" like --config does (for tests, notebooks and scripts)."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  if module_spec is None or not os.path.exists(path):
    raise ConfigError(f"config: no config file at {path!r}")
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
  except SyntaxError as e:
    where = f" (line {e.lineno})" if e.lineno else ""
    raise ConfigError(f"config: {path!r} is not a Python config file: {e.msg}{where}") from None
  return module.get_config(arg or None)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """A validated run: every part typed, nothing read from the ConfigDict after `validate`.

  Attributes:
    seed, steps, batch_size (global), eval_every, log_every, checkpoint_every (0 = at the end
      only), keep_checkpoints: the training schedule.
    mesh: devices per mesh axis. model: the model's spec. layout: the configured layout.
    hetero: emulated heterogeneity. resize: whom (a fixed schedule) and how to resize.
    balance: the balancing policy and its knobs. optimizer, data: their settings.
    source: the config as a plain dict (what workdir/config.json records).
    sync: how data-parallel replicas combine (`config.sync`, `hetero.replica_slowdown`).
    pipeline: a pipelined or planned run's settings, else None.
    profile: the trace and the MFU peak (`config.profile`).
    run_ahead: whether steps may run ahead of the host (`trainer` module doc).
    kernel: how a device computes its width of a block (`layout.kernel`, `Plan.kernel`).
    accumulation: microbatches a tensor-parallel step runs before its one update
      (`gradient_accumulation_steps`).
  """

  seed: int
  steps: int
  batch_size: int
  eval_every: int
  log_every: int
  checkpoint_every: int
  keep_checkpoints: int
  mesh: mesh_lib.MeshSpec
  model: spec_lib.ModelSpec
  layout: layout_lib.Layout
  hetero: emulation.Hetero
  resize: resize_spec_lib.ResizeSpec
  balance: settings_lib.BalanceSettings
  optimizer: optimizer_lib.OptimizerSpec
  data: data_lib.DataSpec
  source: dict = dataclasses.field(compare=False, repr=False)
  sync: sync_settings_lib.SyncSettings = sync_settings_lib.SyncSettings()
  pipeline: "PipelineSpec | None" = None
  profile: profile_lib.ProfileSpec = profile_lib.ProfileSpec()
  run_ahead: bool = True
  kernel: str = "auto"
  accumulation: int = 1


@dataclasses.dataclass(frozen=True)
class PipelineSpec:
  """A pipelined or planned run (`config.pipeline`, `config.plan`, `config.planner`,
  `hetero.device_speeds`, `hetero.links`); `RunConfig.pipeline` is None for other runs.

  Attributes:
    schedule: "gpipe" or "1f1b".
    microbatches: microbatches per data-parallel pipeline (len mesh.data).
    layers: "even" or layers per stage (len mesh.pipe).
    layer_capacity: layer slots compiled per stage (0: the most any stage holds).
    microbatch_capacity: microbatches compiled per pipeline (0: `pipeline_setup.microbatch_slots`).
    mlp, heads: "even", or per stage a tuple of units per tensor device.
    num_widths: compute widths compiled per kind (`layout.num_widths`).
    plan: "", "auto" or the path of a plan's JSON.
    microbatch_sizes, schedules: the planner's choices (() sizes: every divisor of the batch).
    devices: the emulated speeds and links (`core.emulation.Devices`), or None.
    memory_gb: memory of every device for the planner (0: unbounded).
    syncs: the data-parallel sync modes the planner chooses among (`config.planner.syncs`).
    rotate_every: steps between shifts of the emulated speeds by one device id
      (`hetero.rotate_every`; 0 = static).
  """

  schedule: str
  microbatches: tuple[int, ...]
  layers: object
  layer_capacity: int
  mlp: object
  heads: object
  num_widths: int
  plan: str = ""
  microbatch_sizes: tuple[int, ...] = ()
  schedules: tuple[str, ...] = ("gpipe", "1f1b")
  devices: emulation.Devices | None = None
  memory_gb: float = 0.0
  syncs: tuple[str, ...] = ("sync",)
  rotate_every: int = 0
  microbatch_capacity: int = 0


def _check_keys(node, schema: dict, prefix: str) -> None:
  for key in node.keys():
    if key not in schema:
      raise ConfigError(f"{prefix}.{key}: unknown config key; known keys of {prefix}: "
                        f"{sorted(schema)}")
    if isinstance(schema[key], dict):
      _check_keys(node[key], schema[key], f"{prefix}.{key}")


def _bool(value, field: str) -> bool:
  if not isinstance(value, bool):
    raise ConfigError(f"config.{field}: must be True or False, got {value!r}")
  return value


def _kernel(config, spec, num_devices: int | None) -> str:
  """`layout.kernel`, checked, and with it the model's remat policy where the backend is known
  (`num_devices` given)."""
  kernel = config.layout.get("kernel", "auto")
  try:
    width_gemm.resolve(kernel, "cpu")        # names layout.kernel when it is not one of them
    if num_devices is not None:
      remat.check(spec.precision.remat_policy, kernel)
  except ValueError as e:
    raise ConfigError(f"config.{e}") from None
  return kernel


def _int(value, field: str, minimum: int = 1) -> int:
  if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
    raise ConfigError(f"config.{field}: must be an integer >= {minimum}, got {value!r}")
  return int(value)


def _text_items(value) -> list[str] | None:
  """The comma-separated items of a string (or a 1-tuple holding one, as --config.x='(1,2)'
  gives for a tuple field), else None."""
  if isinstance(value, (tuple, list)) and len(value) == 1 and isinstance(value[0], str):
    value = value[0]
  if not isinstance(value, str):
    return None
  return [v for v in value.strip().strip("()[]").replace(" ", "").split(",") if v]


def parse_counts(value, field: str):
  """"even", a sequence of ints, or a string "3,5,8" / "(3, 5, 8)" -> "even" or a tuple."""
  if isinstance(value, str) and value.strip() == "even":
    return "even"
  items = _text_items(value)
  try:
    if items is not None:
      return tuple(int(v) for v in items)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
      return (int(value),)
    return tuple(int(v) for v in value)
  except (TypeError, ValueError):
    raise ConfigError(f"{field}: {value!r} is not 'even' or a list of unit counts, one per "
                      "tensor device") from None


def parse_numbers(value, field: str) -> tuple[float, ...]:
  """A sequence of numbers, or a string "1,4,1" / "(1, 4, 1)", as a tuple of floats."""
  items = _text_items(value)
  if isinstance(value, numbers.Real) and not isinstance(value, bool):
    items = [value]
  try:
    values = items if items is not None else list(value)
    out = []
    for v in values:
      if isinstance(v, bool) or isinstance(v, str) and items is None:
        raise ValueError
      out.append(float(v))
    return tuple(out)
  except (TypeError, ValueError):
    raise ConfigError(f"{field}: {value!r} is not a list of numbers") from None


def parse_devices(value, field: str = "config.resize.straggler"):
  """"rotate", "" or device indices: a tuple, one index, or a string "3,5" / "(3,)"."""
  if isinstance(value, str) and value.strip() in ("", "rotate"):
    return value.strip()
  items = _text_items(value)
  try:
    if items is not None:
      return tuple(int(v) for v in items)
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
      return (int(value),)
    return tuple(value)
  except (TypeError, ValueError):
    raise ConfigError(f"{field}: {value!r} is not 'rotate' or device indices") from None


def validate(config, num_devices: int | None = None, process_count: int = 1) -> RunConfig:
  """Checks a whole config before anything is compiled or loaded; returns the typed run.

  Args:
    config: a ConfigDict built on `base_config()`.
    num_devices: devices available (jax.device_count()); None skips that check.
    process_count: processes sharing the global batch.

  Raises:
    ConfigError: naming the first bad field, what is wrong and what is allowed.
  """
  model_cfg = config.get("model", {})
  name = model_cfg.get("name")
  model_cls = models.model_class(name)
  schema = base_config().to_dict()
  schema["model"] = {k: None for k in ("name",) + model_cls.FIELDS + models.PRECISION_FIELDS}
  _check_keys(config, schema, "config")
  spec = models.spec(name, {k: v for k, v in model_cfg.items() if k != "name"},
                     backend=None if num_devices is None else jax.default_backend())
  for field in ("steps", "batch_size", "eval_every", "log_every", "keep_checkpoints",
                "gradient_accumulation_steps"):
    _int(config[field], field)
  _int(config.seed, "seed", 0)
  _int(config.checkpoint_every, "checkpoint_every", 0)
  mesh = mesh_lib.MeshSpec(_int(config.mesh.data, "mesh.data"),
                           _int(config.mesh.tensor, "mesh.tensor"), _int(config.mesh.pipe,
                                                                          "mesh.pipe"))
  if num_devices is not None and mesh.size > num_devices and not config.plan:
    raise ConfigError(f"config.mesh: data * pipe * tensor = {mesh.data} * {mesh.pipe} * "
                      f"{mesh.tensor} devices, but only {num_devices} are available")
  if mesh.pipe > 1 or config.plan:
    return _pipelined(config, spec, mesh, num_devices, process_count)
  if config.batch_size % (mesh.data * process_count):
    raise ConfigError(f"config.batch_size: {config.batch_size} is not divisible by mesh.data "
                      f"* processes = {mesh.data} * {process_count}")
  accumulation = config.gradient_accumulation_steps
  if config.batch_size % (mesh.data * process_count * accumulation):
    raise ConfigError(f"config.gradient_accumulation_steps: batch_size {config.batch_size} does "
                      f"not split into {accumulation} microbatches over mesh.data * processes = "
                      f"{mesh.data} * {process_count}")
  try:
    layout = layout_lib.Layout.for_model(
        d_model=spec.d_model, num_heads=spec.num_units()["heads"], d_ff=spec.d_ff,
        num_devices=mesh.tensor, mlp=parse_counts(config.layout.mlp, "config.layout.mlp"),
        heads=parse_counts(config.layout.heads, "config.layout.heads"),
        num_widths=_int(config.layout.num_widths, "layout.num_widths"))
  except LayoutError as e:
    raise ConfigError(f"config.{e}{heads_note(spec, str(e))}") from None
  slowdown = parse_numbers(config.hetero.slowdown, "config.hetero.slowdown") or None
  hetero = emulation.Hetero(slowdown, config.hetero.device_gflops, config.hetero.rotate_every,
                            config.hetero.repeated).validate(mesh.tensor)
  resize = _resize(config.resize, mesh.tensor)
  balance = _balance(config, hetero, resize,
                     None if num_devices is None else jax.default_backend())
  data = data_lib.DataSpec.from_config(config)
  sync = _sync(config, mesh, balance, resize, num_devices, process_count)
  optimizer = optimizer_lib.OptimizerSpec.from_config(config.optimizer).resolved(
      spec.precision.dtype)
  return RunConfig(config.seed, config.steps, config.batch_size, config.eval_every,
                   config.log_every, config.checkpoint_every, config.keep_checkpoints, mesh,
                   spec, layout, hetero, resize, balance, optimizer, data, config.to_dict(),
                   sync=sync, profile=profile_lib.ProfileSpec.from_config(config),
                   run_ahead=_bool(config.run_ahead, "run_ahead"),
                   kernel=_kernel(config, spec, num_devices), accumulation=accumulation)


# `semi` on a pipelined run re-plans its layers per stage and each stage's units online
# (`balance.replan`, `train.stage_balance`) on the emulated speeds of `hetero.device_speeds`.
PIPELINE_POLICIES = ("even", "static", "semi")


def _pipelined(config, spec: spec_lib.ModelSpec, mesh: mesh_lib.MeshSpec,
               num_devices: int | None, process_count: int) -> RunConfig:
  """`validate` for a pipelined or planned run (mesh.pipe > 1 or config.plan): what such a run
  reads, and the features it does not combine with."""
  plan = config.plan
  if not isinstance(plan, str) or (plan not in ("", "auto") and not os.path.isfile(plan)):
    raise ConfigError(f"config.plan: {plan!r} is not '', 'auto' or an existing plan file "
                      "(experiments/plan.py --out)")
  refused = (("hetero.slowdown", config.hetero.slowdown, "hetero.device_speeds"),
             ("hetero.replica_slowdown", config.hetero.replica_slowdown, "hetero.device_speeds"),
             ("resize.keep", config.resize.keep, None),
             ("resize.straggler", config.resize.straggler, None))
  for name, value, instead in refused:
    if value not in ((), [], "", None):     # [] where the config came from JSON
      hint = f"; use config.{instead}" if instead else ""
      raise ConfigError(f"config.{name}: pipelined and planned runs (mesh.pipe > 1 or "
                        f"config.plan) do not take it{hint}")
  if config.gradient_accumulation_steps != 1:
    raise ConfigError("config.gradient_accumulation_steps: pipelined and planned runs (mesh.pipe "
                      "> 1 or config.plan) split the batch into config.pipeline.microbatches "
                      "instead; leave it at 1")
  if config.balance.policy not in PIPELINE_POLICIES:
    raise ConfigError(f"config.balance.policy: pipelined and planned runs keep the layout of "
                      f"their config or plan, or re-plan it ('semi'): policies "
                      f"{list(PIPELINE_POLICIES)}, not {config.balance.policy!r}")
  schedule = config.pipeline.schedule
  if schedule not in schedule_lib.SCHEDULES:
    raise ConfigError(f"config.pipeline.schedule: {schedule!r} is not one of "
                      f"{list(schedule_lib.SCHEDULES)}")
  micro = tuple(_int(m, "pipeline.microbatches") for m in parse_numbers_int(
      config.pipeline.microbatches, "config.pipeline.microbatches"))
  if len(micro) == 1:
    micro = micro * mesh.data
  if len(micro) != mesh.data and not plan:
    raise ConfigError(f"config.pipeline.microbatches: {micro} for mesh.data = {mesh.data} "
                      "pipelines; give one count or one per pipeline")
  if not plan and config.batch_size % sum(micro):
    raise ConfigError(f"config.batch_size: {config.batch_size} examples do not split into "
                      f"{sum(micro)} microbatches of one size (pipeline.microbatches {micro})")
  layers = parse_counts(config.pipeline.layers, "config.pipeline.layers")
  if layers != "even" and not plan and (len(layers) != mesh.pipe or min(layers) < 1
                                        or sum(layers) != spec.num_layers):
    raise ConfigError(f"config.pipeline.layers: {layers} must give each of the mesh.pipe = "
                      f"{mesh.pipe} stages at least one layer and sum to model.num_layers = "
                      f"{spec.num_layers}")
  if mesh.pipe > spec.num_layers:
    raise ConfigError(f"config.mesh.pipe: {mesh.pipe} stages for {spec.num_layers} layers")
  capacity = _int(config.pipeline.layer_capacity, "pipeline.layer_capacity", 0)
  units = {}
  for kind, total in spec.num_units().items():
    counts = parse_counts(config.layout[kind], f"config.layout.{kind}")
    if counts != "even" and not plan:
      if len(counts) == mesh.tensor:
        counts = (counts,) * mesh.pipe
      elif len(counts) == mesh.tensor * mesh.pipe:
        counts = tuple(counts[p * mesh.tensor:(p + 1) * mesh.tensor] for p in range(mesh.pipe))
      else:
        raise ConfigError(f"config.layout.{kind}: {len(counts)} counts; give mesh.tensor = "
                          f"{mesh.tensor} (every stage alike) or pipe x tensor = "
                          f"{mesh.pipe * mesh.tensor}")
      for p, c in enumerate(counts):
        if sum(c) != total or min(c) < 0:
          raise ConfigError(f"config.layout.{kind}: stage {p} has counts {c}; each must be >= 0 "
                            f"and they must sum to the model's {total}"
                            f"{heads_note(spec, 'layout.' + kind)}")
    units[kind] = counts
  devices = _devices(config.hetero, mesh, num_devices, bool(plan))
  g = config.hetero.device_gflops
  if isinstance(g, bool) or not isinstance(g, (int, float)) or not math.isfinite(g) or g <= 0:
    raise ConfigError(f"config.hetero.device_gflops: must be a positive number, got {g!r}")
  memory = config.hetero.device_memory_gb
  if isinstance(memory, bool) or not isinstance(memory, (int, float)) or not memory >= 0:
    raise ConfigError(f"config.hetero.device_memory_gb: must be a number >= 0, got {memory!r}")
  sizes = tuple(_int(m, "planner.microbatch_sizes") for m in parse_numbers_int(
      config.planner.microbatch_sizes, "config.planner.microbatch_sizes"))
  bad = [m for m in sizes if config.batch_size % m]
  if bad:
    raise ConfigError(f"config.planner.microbatch_sizes: {bad} do not divide batch_size = "
                      f"{config.batch_size}")
  schedules = tuple(config.planner.schedules)
  if not schedules or any(x not in schedule_lib.SCHEDULES for x in schedules):
    raise ConfigError(f"config.planner.schedules: need a non-empty subset of "
                      f"{list(schedule_lib.SCHEDULES)}, got {schedules}")
  syncs = _syncs(config)
  rotate = config.hetero.rotate_every
  if isinstance(rotate, bool) or not isinstance(rotate, int) or rotate < 0:
    raise ConfigError(f"config.hetero.rotate_every: must be an integer >= 0, got {rotate!r}")
  if rotate and not parse_numbers(config.hetero.device_speeds, "config.hetero.device_speeds"):
    raise ConfigError("config.hetero.rotate_every: a pipelined or planned run rotates "
                      "hetero.device_speeds; set them")
  pipeline = PipelineSpec(schedule, micro, layers, capacity, units["mlp"], units["heads"],
                          _int(config.layout.num_widths, "layout.num_widths"), plan, sizes,
                          schedules, devices, float(memory), syncs, rotate,
                          _int(config.pipeline.microbatch_capacity,
                               "pipeline.microbatch_capacity", 0))
  layout = layout_lib.Layout.for_model(d_model=spec.d_model,
                                       num_heads=spec.num_units()["heads"], d_ff=spec.d_ff,
                                       num_devices=1)
  hetero = emulation.Hetero(None, float(g), 0)
  resize = resize_spec_lib.ResizeSpec().validate(1)
  known = {f.name for f in dataclasses.fields(settings_lib.BalanceSettings)}
  balance = settings_lib.BalanceSettings(**{k: v for k, v in config.balance.items()
                                            if k in known}).validate(policies_lib.REGISTRY)
  _check_replanning(balance, devices, config.sync.mode, syncs, process_count)
  # A plan's pipelines are counted when it is made (`pipeline_setup.for_plan` validates again).
  sync = _sync_settings(config, None if plan else mesh.data)
  if process_count > 1 and (set(syncs) | {sync.mode}) != {"sync"}:
    raise ConfigError(f"config.sync.mode: pipelined runs over {process_count} processes combine "
                      f"their pipelines synchronously ('sync'); the replica modes "
                      f"{sorted((set(syncs) | {sync.mode}) - {'sync'})} run pipelines in one "
                      "process")
  optimizer = optimizer_lib.OptimizerSpec.from_config(config.optimizer).resolved(
      spec.precision.dtype)
  return RunConfig(config.seed, config.steps, config.batch_size, config.eval_every,
                   config.log_every, config.checkpoint_every, config.keep_checkpoints, mesh,
                   spec, layout, hetero, resize, balance, optimizer,
                   data_lib.DataSpec.from_config(config), config.to_dict(), sync=sync,
                   pipeline=pipeline, profile=profile_lib.ProfileSpec.from_config(config),
                   run_ahead=_bool(config.run_ahead, "run_ahead"),
                   kernel=_kernel(config, spec, num_devices))


def _check_replanning(balance: settings_lib.BalanceSettings, devices, mode: str, syncs,
                      process_count: int) -> None:
  """Raises ConfigError naming the field where a pipelined `semi` run cannot re-plan: it reads
  emulated speeds (`hetero.device_speeds`) or times the devices with the probe, in the `sync`
  mode, in one process."""
  if balance.policy != "semi":
    return
  measure = balance.measure
  if devices is not None and measure not in ("auto", "emulated"):
    raise ConfigError(f"config.balance.measure: a pipelined run with hetero.device_speeds or "
                      f"hetero.links re-plans on their emulated speeds ('emulated' or 'auto'), "
                      f"not {measure!r}")
  if devices is None and measure not in ("auto", "probe"):
    raise ConfigError(f"config.balance.measure: a pipelined run times its devices with the probe "
                      f"('probe' or 'auto'; 'emulated' needs hetero.device_speeds), not "
                      f"{measure!r}")
  if mode != "sync" or set(syncs) != {"sync"}:
    raise ConfigError("config.sync.mode: a pipelined 'semi' run combines its pipelines with "
                      f"'sync' (a re-plan would have to move in-flight replica state), not "
                      f"{sorted(set(syncs) | {mode})}")
  if process_count > 1:
    raise ConfigError(f"config.balance.policy: a pipelined 'semi' run re-plans in one process, "
                      f"not over {process_count}")


def _syncs(config) -> tuple[str, ...]:
  """`config.planner.syncs` -> the sync modes the planner chooses among (() = sync.mode's)."""
  value = config.planner.syncs
  if isinstance(value, str):
    value = value.split(",")
  syncs = tuple(str(x).strip() for x in value if str(x).strip()) or (config.sync.mode,)
  bad = [x for x in syncs if x not in sync_settings_lib.MODES]
  if bad:
    raise ConfigError(f"config.planner.syncs: {bad} are not sync modes "
                      f"{list(sync_settings_lib.MODES)}")
  return syncs


def parse_numbers_int(value, field: str) -> tuple[int, ...]:
  """`parse_numbers` for counts: every value a whole number."""
  out = parse_numbers(value, field)
  if any(v != int(v) for v in out):
    raise ConfigError(f"{field}: {value!r} is not a list of whole numbers")
  return tuple(int(v) for v in out)


def _region_matrix(value, regions: int, field: str, default: float, positive: bool):
  """(inside, between) or R x R values row by row -> a symmetric float [R, R] matrix."""
  values = parse_numbers(value, field)
  if not values:
    return np.full((regions, regions), default)
  if len(values) == 2:
    m = np.where(np.eye(regions, dtype=bool), values[0], values[1])
  elif len(values) == regions * regions:
    m = np.asarray(values).reshape(regions, regions)
  else:
    raise ConfigError(f"{field}: {len(values)} values for {regions} regions; give (inside, "
                      f"between) or {regions} x {regions} = {regions * regions} row by row")
  if np.any(np.isnan(m)) or np.any(m <= 0 if positive else m < 0) or not np.array_equal(m, m.T):
    raise ConfigError(f"{field}: need a symmetric matrix of {'positive' if positive else '>= 0'}"
                      f" values, got {m.tolist()}")
  return m


def _devices(h, mesh: mesh_lib.MeshSpec, num_devices: int | None,
             planned: bool) -> emulation.Devices | None:
  """`hetero.device_speeds` and `hetero.links` -> emulated `Devices`, or None when neither is
  set."""
  speeds = parse_numbers(h.device_speeds, "config.hetero.device_speeds")
  regions = parse_numbers_int(h.links.regions, "config.hetero.links.regions")
  links = [parse_numbers(h.links[k], f"config.hetero.links.{k}") for k in ("latency_s",
                                                                          "bandwidth")]
  if not speeds and not regions and not any(links):
    return None
  n = mesh.size if not planned else (num_devices or len(speeds) or len(regions))
  if planned and num_devices is not None and speeds and len(speeds) != num_devices:
    raise ConfigError(f"config.hetero.device_speeds: {len(speeds)} speeds, but the planner "
                      f"places all {num_devices} devices")
  speeds = speeds or (1.0,) * n
  regions = regions or (0,) * n
  for name, got in (("device_speeds", speeds), ("links.regions", regions)):
    if len(got) != n:
      raise ConfigError(f"config.hetero.{name}: {len(got)} values for the run's {n} devices "
                        "(one per device id)")
  if any(not math.isfinite(v) or v <= 0 for v in speeds):
    raise ConfigError(f"config.hetero.device_speeds: need positive finite speeds, got {speeds}")
  if min(regions) < 0:
    raise ConfigError(f"config.hetero.links.regions: need indices >= 0, got {regions}")
  r = max(regions) + 1
  lat = _region_matrix(h.links.latency_s, r, "config.hetero.links.latency_s", 0.0, False)
  bw = _region_matrix(h.links.bandwidth, r, "config.hetero.links.bandwidth", math.inf, True)
  return emulation.Devices.from_regions(speeds, regions, lat, bw)


# Balancing policies whose steps a replica mode can run: they change no layout while training
# (a migration would have to move the replicas' in-flight state too) and never resize (a late
# gradient would be applied to units that were skipped when it was computed).
REPLICA_MODE_POLICIES = ("even", "static")


def _sync(config, mesh: mesh_lib.MeshSpec, balance: settings_lib.BalanceSettings,
          resize: resize_spec_lib.ResizeSpec, num_devices: int | None,
          process_count: int) -> sync_settings_lib.SyncSettings:
  """`config.sync` and `config.hetero.replica_slowdown` -> validated `SyncSettings`."""
  sync = _sync_settings(config, mesh.data)
  if sync.mode == "sync":
    return sync
  if balance.policy not in REPLICA_MODE_POLICIES or resize.scheduled:
    raise ConfigError(f"config.balance.policy: sync.mode {sync.mode!r} runs with policies "
                      f"{list(REPLICA_MODE_POLICIES)} and no resize schedule, not "
                      f"{balance.policy!r}: migrations and resizing do not yet carry the "
                      "replicas' in-flight state")
  if process_count > 1:
    if mesh.data != process_count:
      raise ConfigError(f"config.mesh.data: sync.mode {sync.mode!r} over {process_count} "
                        f"processes runs one replica per process; got mesh.data = {mesh.data}")
    if num_devices is not None and mesh.tensor * process_count != num_devices:
      raise ConfigError(f"config.mesh.tensor: each process's {num_devices // process_count} "
                        f"devices form its replica's tensor group; got mesh.tensor = "
                        f"{mesh.tensor}")
    if sync.replica_slowdown is not None:
      raise ConfigError("config.hetero.replica_slowdown: emulates replicas in one process; "
                        "with several processes their real speeds count")
  return sync


def _sync_settings(config, num_replicas: int | None) -> sync_settings_lib.SyncSettings:
  """`config.sync` and `config.hetero.replica_slowdown` -> `SyncSettings` validated for
  `num_replicas` replicas (None: not known yet)."""
  known = {f.name for f in dataclasses.fields(sync_settings_lib.SyncSettings)}
  replicas = parse_numbers(config.hetero.replica_slowdown,
                           "config.hetero.replica_slowdown") or None
  return sync_settings_lib.SyncSettings(
      **{k: v for k, v in config.sync.items() if k in known},
      replica_slowdown=replicas).validate(num_replicas)


def _resize(r, num_devices: int) -> resize_spec_lib.ResizeSpec:
  """`config.resize` -> a validated ResizeSpec (scheduled or not)."""
  keep = parse_numbers(r.keep, "config.resize.keep")
  return resize_spec_lib.ResizeSpec(
      keep=keep, straggler=parse_devices(r.straggler), straggler_keep=r.straggler_keep,
      mode=r.mode, imputation=r.imputation, priority=r.priority, freeze=bool(r.freeze),
      fill_value=r.fill_value, epoch_steps=r.epoch_steps, refresh_every=r.refresh_every,
      fractions=parse_numbers(r.fractions, "config.resize.fractions")).validate(num_devices)


def _balance(config, hetero: emulation.Hetero, resize: resize_spec_lib.ResizeSpec,
             backend: str | None = None) -> settings_lib.BalanceSettings:
  """`config.balance` -> validated `BalanceSettings`, and the combinations it cannot run
  (`backend`: the devices' platform, None = not checked)."""
  known = {f.name for f in dataclasses.fields(settings_lib.BalanceSettings)}
  settings = settings_lib.BalanceSettings(**{k: v for k, v in config.balance.items()
                                             if k in known}).validate(policies_lib.REGISTRY)
  if settings.measure == "emulated" and hetero.slowdown is None:
    raise ConfigError("config.balance.measure: 'emulated' needs config.hetero.slowdown")
  if settings.measure == "sched" and backend not in (None, "cpu"):
    raise ConfigError(f"config.balance.measure: 'sched' reads the CPU share of the host's "
                      f"threads, which says nothing of a {backend} device's speed; use 'probe' "
                      "or 'auto'")
  if settings.policy == "even":
    for kind in ("mlp", "heads"):
      if parse_counts(config.layout[kind], f"config.layout.{kind}") != "even":
        raise ConfigError(f"config.layout.{kind}: balance.policy 'even' runs the even split; "
                          f"got {config.layout[kind]!r} (use policy 'static' for a fixed split)")
  if resize.scheduled and settings.policy != "static":
    raise ConfigError(f"config.resize.keep / config.resize.straggler: a fixed resize schedule "
                      f"runs with balance.policy 'static' only, not {settings.policy!r} (the "
                      "controller decides who is resized)")
  return settings


def heads_note(spec: spec_lib.ModelSpec, message: str) -> str:
  """What a refusal about `layout.heads` adds for a model with grouped-query attention, whose
  "heads" units are KV groups; "" otherwise."""
  if not spec.num_kv_heads or not message.startswith("layout.heads"):
    return ""
  return (f" (for model {spec.name!r}, layout.heads counts KV groups: model.num_kv_heads = "
          f"{spec.num_kv_heads})")


def speed_proportional(config, slowdown) -> ml_collections.ConfigDict:
  """A copy of `config` whose layout gives each tensor device units in proportion to its speed."""
  out = copy.deepcopy(config)
  speeds = [1.0 / s for s in slowdown]
  with out.unlocked():
    out.layout.mlp = layout_lib.proportional_counts(config.model.d_ff, speeds)
    heads = config.model.get("num_kv_heads", config.model.num_heads)   # KV groups, if any
    out.layout.heads = layout_lib.proportional_counts(heads, speeds)
  return out
