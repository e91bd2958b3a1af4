"""Configuration: the shared defaults every config file extends, argument parsing, validation.

Config files in `configs/` start from `base_config()` and define `get_config(arg)`. The field
names below are a public contract (scripts rely on them):

  config.mesh.data, config.mesh.tensor         devices per mesh axis
  config.layout.mlp, config.layout.heads       "even", or one owned-unit count per tensor device
                                               (a tuple, or a string like "30,30,8,30")
  config.layout.num_widths                     compiled compute widths per unit kind
  config.hetero.slowdown                       one factor per tensor device (4.0 = four times
                                               slower, emulated), or () for none
  config.hetero.device_gflops                  emulated speed of a nominal device
  config.steps, config.seed, config.batch_size (global), config.eval_every, config.model.*

`validate(config)` refuses bad input before anything is compiled or loaded, with a
`ConfigError` whose message starts with the field name ("config.hetero.slowdown: ...").
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import math
import os

import jax
import ml_collections
import optax

from semijax import errors
from semijax import models
from semijax.balance import controller as controller_lib
from semijax.core import layout as layout_lib
from semijax.core import resize as resize_lib


ConfigError = errors.ConfigError


def base_config() -> ml_collections.ConfigDict:
  """Defaults shared by every config; config files override what they need."""
  c = ml_collections.ConfigDict()
  c.seed = 0                       # Initialization and data order.
  c.steps = 200                    # Optimizer steps in total (a resumed run continues to this).
  c.batch_size = 16                # Global batch (split over mesh.data and processes).
  c.eval_every = 50                # Steps between validation passes (and at the last step).
  c.log_every = 10                 # Steps between metric lines / progress reports.
  c.checkpoint_every = 100         # Steps between checkpoints (and at the last step); 0 = end only.
  c.keep_checkpoints = 2           # Checkpoints kept in workdir/checkpoints.

  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = 1                  # Data-parallel replicas (batch split).
  c.mesh.tensor = 8                # Tensor-parallel devices (uneven units).

  c.layout = ml_collections.ConfigDict()
  # "even" or owned units per tensor device: a tuple, or "30,30,8,30" (typed `object` so that
  # both a string and a tuple can be assigned, in Python or with --config.layout.mlp=...).
  c.layout.mlp = ml_collections.FieldReference("even", field_type=object)     # MLP units
  c.layout.heads = ml_collections.FieldReference("even", field_type=object)   # attention heads
  c.layout.num_widths = 4          # Compute widths compiled per unit kind.

  c.hetero = ml_collections.ConfigDict()
  c.hetero.slowdown = ()           # Per tensor device slowdown factors; () = no emulation.
  c.hetero.device_gflops = 2.0     # Emulated FLOP rate of a nominal device (GFLOP/s).
  c.hetero.rotate_every = 0        # Steps between shifts of the slowdown profile by one device
                                   # ((8,1,...,1) rotating = the authors' dynamic straggler); 0 = static.

  # Balancing (semijax.balance, semijax.controller): who does how much work, online.
  c.balance = ml_collections.ConfigDict()
  c.balance.policy = "static"      # even | static | resize | migrate | offload | semi
  # Speeds from: "emulated" (the hetero.slowdown profile), "sched" (Linux scheduler stats: the
  # CPU share each process gets), "probe" (timing a small matmul); "auto": emulated if
  # hetero.slowdown is set, else sched where available, else probe.
  c.balance.measure = "auto"
  c.balance.capacity_factor = 2.0  # dynamic policies: bucket capacity = factor x the even share
  c.balance.num_widths = 0         # compute widths in that bucket; 0 = layout.num_widths
  c.balance.probe_every = 4        # steps between speed samples (and decisions)
  c.balance.probe_size = 128       # probe: [size, size] matmuls ...
  c.balance.probe_repeats = 4      # ... this many in a row
  c.balance.alpha = 0.3            # smoothing weight of a new measurement
  c.balance.change_threshold = 0.2 # a speed change by this factor is a candidate new regime ...
  c.balance.confirm = 2            # ... once it lasts this many samples (shorter: a burst)
  c.balance.hysteresis = 0.05      # a change must be predicted this much faster ...
  c.balance.patience = 2           # ... in this many decisions in a row
  c.balance.min_dwell_steps = 5    # steps between migrations at least
  c.balance.slow_threshold = 0.85  # relative speed below which a device counts as slow
  c.balance.resize_budget = 0.5    # semi: the largest share of a device's units it may skip
  c.balance.resize_keep = 0.5      # resize policy: keep ratio of a slow device (the authors')
  c.balance.resize_penalty = 0.05  # accuracy cost of resizing, as a share of step time
  c.balance.resize_horizon_steps = 8  # semi resizes only slowdowns expected to end within this
  c.balance.fixed_fraction = 0.1   # cost model prior: share of a step that no split changes

  # ZERO-resizing (semijax.resize): who computes only part of its units, and how.
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

  c.optimizer = ml_collections.ConfigDict()
  c.optimizer.learning_rate = 3e-3
  c.optimizer.warmup_steps = 20
  c.optimizer.weight_decay = 0.1
  c.optimizer.b1 = 0.9
  c.optimizer.b2 = 0.95
  c.optimizer.grad_clip = 1.0      # Global gradient-norm clip; 0 = none.

  c.model = ml_collections.ConfigDict()   # name + the fields of models.FIELDS[name]
  c.data = ml_collections.ConfigDict()
  c.data.name = ""                 # gpt: "pydoc" | "text_file"; vit: "digits" | "npy".
  c.data.path = ""                 # text_file: a UTF-8 or binary file of training text.
  c.data.images = ""               # npy: images [N, H, W(, C)].
  c.data.labels = ""               # npy: int labels [N].
  c.data.val_fraction = 0.1        # Held-out share for validation.
  c.data.eval_batches = 4          # gpt: validation batches per evaluation.
  return c


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses a config-file argument like "cpu,tensor=4" over typed `defaults`.

  A bare name sets a bool default to True; `key=value` converts value to the default's type.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    key, _, value = item.partition("=")
    if key not in defaults:
      raise ConfigError(f"config argument: unknown option {key!r}; known: {sorted(defaults)}")
    kind = type(defaults[key])
    if kind is bool:
      out[key] = value.lower() not in ("0", "false", "no") if value else True
    else:
      out[key] = kind(value)
  return out


def load(spec: str) -> ml_collections.ConfigDict:
  """Loads "path/to/config.py[:arg]" like --config does (for tests, notebooks and scripts)."""
  path, _, arg = spec.partition(":")
  module_spec = importlib.util.spec_from_file_location(
      os.path.splitext(os.path.basename(path))[0], path)
  if module_spec is None or not os.path.exists(path):
    raise ConfigError(f"config: no config file at {path!r}")
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg or None)


@dataclasses.dataclass(frozen=True)
class Parsed:
  """What `validate` derives from a config."""

  layout: layout_lib.Layout
  slowdown: tuple[float, ...] | None
  resize: resize_lib.ResizeSpec | None = None   # None: no resizing schedule configured
  resize_how: resize_lib.ResizeSpec = resize_lib.ResizeSpec()   # mode, priority, ... for any resizing
  balance: controller_lib.Settings = controller_lib.Settings(policy="static")


def _check_keys(node, schema: dict, prefix: str) -> None:
  for key in node.keys():
    if key not in schema:
      raise ConfigError(f"{prefix}.{key}: unknown config key; known keys of {prefix}: "
                        f"{sorted(schema)}")
    if isinstance(schema[key], dict):
      _check_keys(node[key], schema[key], f"{prefix}.{key}")


def _schema(model_name: str) -> dict:
  schema = base_config().to_dict()
  schema["model"] = {k: None for k in ("name",) + models.FIELDS[model_name]}
  return schema


def _positive_int(config, path: str, minimum: int = 1) -> int:
  node = config
  for part in path.split("."):
    node = node[part]
  if isinstance(node, bool) or not isinstance(node, int) or node < minimum:
    raise ConfigError(f"config.{path}: must be an integer >= {minimum}, got {node!r}")
  return node


def parse_counts(value, field: str):
  """"even", a sequence of ints, or a string "3,5,8" / "(3, 5, 8)" -> "even" or a tuple."""
  if isinstance(value, str):
    text = value.strip().strip("()[]").replace(" ", "")
    if text == "even":
      return "even"
    try:
      return tuple(int(v) for v in text.split(",") if v)
    except ValueError:
      raise ConfigError(f"{field}: {value!r} is not 'even' or a list of unit counts") from None
  try:
    return tuple(int(v) for v in value)
  except (TypeError, ValueError):
    raise ConfigError(f"{field}: {value!r} is not 'even' or a list of unit counts") from None


def validate(config, num_devices: int | None = None, process_count: int = 1) -> Parsed:
  """Checks a whole config before anything is compiled; returns the derived layout and slowdown.

  Args:
    config: a ConfigDict built on `base_config()`.
    num_devices: devices available (jax.device_count()); None skips that check.
    process_count: processes sharing the global batch.

  Raises:
    ConfigError: naming the first bad field.
  """
  name = config.get("model", {}).get("name")
  if name not in models.FIELDS:
    raise ConfigError(f"config.model.name: {name!r} is not one of {sorted(models.FIELDS)}")
  _check_keys(config, _schema(name), "config")
  for field in models.FIELDS[name]:
    if field not in config.model:
      raise ConfigError(f"config.model.{field}: missing (required for model {name!r})")
    _positive_int(config, f"model.{field}")
  for field in ("steps", "batch_size", "eval_every", "log_every", "keep_checkpoints",
                "mesh.data", "mesh.tensor", "layout.num_widths"):
    _positive_int(config, field)
  _positive_int(config, "checkpoint_every", minimum=0)
  data, tensor = config.mesh.data, config.mesh.tensor
  if num_devices is not None and data * tensor > num_devices:
    raise ConfigError(f"config.mesh: data * tensor = {data} * {tensor} devices, but only "
                      f"{num_devices} are available")
  if config.batch_size % (data * process_count):
    raise ConfigError(f"config.batch_size: {config.batch_size} is not divisible by mesh.data "
                      f"* processes = {data} * {process_count}")
  m = config.model
  try:
    layout = layout_lib.Layout.for_model(
        d_model=m.d_model, num_heads=m.num_heads, d_ff=m.d_ff, num_devices=tensor,
        mlp=parse_counts(config.layout.mlp, "config.layout.mlp"),
        heads=parse_counts(config.layout.heads, "config.layout.heads"),
        num_widths=config.layout.num_widths)
  except layout_lib.LayoutError as e:
    raise ConfigError(f"config.{e}") from None
  slowdown = tuple(config.hetero.slowdown) or None
  if slowdown is not None:
    if len(slowdown) != tensor:
      raise ConfigError(f"config.hetero.slowdown: {len(slowdown)} factors {slowdown} for "
                        f"mesh.tensor = {tensor} devices")
    if not all(isinstance(s, (int, float)) and math.isfinite(s) and s > 0 for s in slowdown):
      raise ConfigError(f"config.hetero.slowdown: factors must be positive numbers, got {slowdown}")
  if not config.hetero.device_gflops > 0:
    raise ConfigError(f"config.hetero.device_gflops: must be positive, got "
                      f"{config.hetero.device_gflops}")
  o = config.optimizer
  if not (o.learning_rate > 0 and math.isfinite(o.learning_rate)):
    raise ConfigError(f"config.optimizer.learning_rate: must be positive, got {o.learning_rate}")
  if not 0 < config.data.val_fraction < 1:
    raise ConfigError(f"config.data.val_fraction: must be in (0, 1), got "
                      f"{config.data.val_fraction}")
  if not (isinstance(config.hetero.rotate_every, int) and config.hetero.rotate_every >= 0):
    raise ConfigError(f"config.hetero.rotate_every: must be an integer >= 0, got "
                      f"{config.hetero.rotate_every!r}")
  resize = parse_resize(config.resize, tensor)
  resize_how = _resize_spec(config.resize)
  balance = parse_balance(config, slowdown, resize)
  return Parsed(layout, slowdown, resize, resize_how, balance)


def parse_balance(config, slowdown, resize) -> controller_lib.Settings:
  """`config.balance` -> validated controller `Settings` (ConfigError naming the field)."""
  b = config.balance
  settings = controller_lib.Settings(
      policy=b.policy, hysteresis=b.hysteresis, patience=b.patience,
      min_dwell_steps=b.min_dwell_steps, slow_threshold=b.slow_threshold,
      resize_budget=b.resize_budget, resize_keep=b.resize_keep, resize_penalty=b.resize_penalty,
      resize_horizon_steps=b.resize_horizon_steps)
  try:
    settings.validate()
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if b.measure not in ("auto", "sched", "probe", "emulated"):
    raise ConfigError(f"config.balance.measure: {b.measure!r} is not 'auto', 'sched', 'probe' "
                      "or 'emulated'")
  if b.measure == "emulated" and slowdown is None:
    raise ConfigError("config.balance.measure: 'emulated' needs config.hetero.slowdown")
  if not b.capacity_factor >= 1:
    raise ConfigError(f"config.balance.capacity_factor: must be >= 1, got {b.capacity_factor!r}")
  for name in ("probe_every", "probe_size", "probe_repeats", "confirm"):
    _positive_int(config, f"balance.{name}")
  _positive_int(config, "balance.num_widths", minimum=0)
  for name in ("alpha", "change_threshold"):
    if not 0 < b[name] <= 1:
      raise ConfigError(f"config.balance.{name}: must be in (0, 1], got {b[name]!r}")
  if not 0 <= b.fixed_fraction < 1:
    raise ConfigError(f"config.balance.fixed_fraction: must be in [0, 1), got "
                      f"{b.fixed_fraction!r}")
  if b.policy == "even":
    for kind in ("mlp", "heads"):
      if parse_counts(config.layout[kind], f"config.layout.{kind}") != "even":
        raise ConfigError(f"config.layout.{kind}: balance.policy 'even' runs the even split; "
                          f"got {config.layout[kind]!r} (use policy 'static' for a fixed split)")
  if resize is not None and b.policy != "static":
    raise ConfigError(f"config.resize.keep / config.resize.straggler: a fixed resize schedule "
                      f"runs with balance.policy 'static' only, not {b.policy!r} (the "
                      "controller decides who is resized)")
  return settings


def _resize_spec(r) -> resize_lib.ResizeSpec:
  """How to resize (mode, imputation, priority, ...), whoever decides whom."""
  spec = resize_lib.ResizeSpec(
      mode=r.mode, imputation=r.imputation, priority=r.priority, freeze=bool(r.freeze),
      fill_value=r.fill_value, epoch_steps=r.epoch_steps, refresh_every=r.refresh_every,
      fractions=tuple(r.fractions))
  try:
    return spec.validate(1)
  except resize_lib.ResizeError as e:
    raise ConfigError(str(e)) from None


def _parse_devices(value):
  """"rotate", "" or device indices (a tuple, or a string "3,5" / "(3,)")."""
  if isinstance(value, str):
    text = value.strip()
    if text in ("", "rotate"):
      return text
    try:
      return tuple(int(v) for v in text.strip("()[]").replace(" ", "").split(",") if v)
    except ValueError:
      raise ConfigError(f"config.resize.straggler: {value!r} is not 'rotate' or device "
                        "indices") from None
  try:
    return tuple(value)
  except TypeError:
    raise ConfigError(f"config.resize.straggler: {value!r} is not 'rotate' or device "
                      "indices") from None


def parse_resize(r, num_devices: int) -> resize_lib.ResizeSpec | None:
  """`config.resize` -> a validated ResizeSpec, or None when nobody is resized."""
  try:
    keep = tuple(r.keep) if not isinstance(r.keep, str) else tuple(
        float(v) for v in r.keep.strip("()[]").split(",") if v.strip())
  except (TypeError, ValueError):
    raise ConfigError(f"config.resize.keep: {r.keep!r} is not a tuple of keep ratios") from None
  spec = resize_lib.ResizeSpec(
      keep=keep, straggler=_parse_devices(r.straggler), straggler_keep=r.straggler_keep,
      mode=r.mode, imputation=r.imputation, priority=r.priority, freeze=bool(r.freeze),
      fill_value=r.fill_value, epoch_steps=r.epoch_steps, refresh_every=r.refresh_every,
      fractions=tuple(r.fractions))
  try:
    spec.validate(num_devices)
  except resize_lib.ResizeError as e:
    raise ConfigError(str(e)) from None
  return spec if spec.enabled else None


def speed_proportional(config, slowdown) -> ml_collections.ConfigDict:
  """A copy of `config` whose layout gives each tensor device units in proportion to its speed."""
  out = copy.deepcopy(config)
  speeds = [1.0 / s for s in slowdown]
  with out.unlocked():
    out.layout.mlp = layout_lib.proportional_counts(config.model.d_ff, speeds)
    out.layout.heads = layout_lib.proportional_counts(config.model.num_heads, speeds)
  return out


def optimizer(config) -> optax.GradientTransformation:
  """AdamW with linear warmup and cosine decay; weight decay on matrices only; optional clip."""
  o = config.optimizer
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  tx = optax.adamw(learning_rate_schedule(config), b1=o.b1, b2=o.b2,
                   weight_decay=o.weight_decay, mask=decay_mask)
  if o.grad_clip > 0:
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip), tx)
  return tx


def learning_rate_schedule(config) -> optax.Schedule:
  o = config.optimizer
  warmup = min(o.warmup_steps, config.steps - 1)
  return optax.warmup_cosine_decay_schedule(0.0, o.learning_rate, warmup, config.steps,
                                            o.learning_rate * 0.1)
