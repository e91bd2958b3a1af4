"""Performance accounting of a run (`config.profile`): a `jax.profiler` trace of chosen steps,
and the achieved model TFLOP/s per device and MFU of every step.

The trace covers steps start_step .. start_step + num_steps - 1 (1-based, as the console counts)
and lands in the workdir's TensorBoard directory (`plugins/profile/<time>/<host>.xplane.pb`,
which TensorBoard's profile plugin and Perfetto open). Every process traces its own devices.

`Throughput` turns a step's samples and seconds into `train/tflops_per_device`: the model's
training FLOPs (`core.flops.train_flops_per_example`) over the job's devices, and `train/mfu`
against the peak of the devices' kind in the run's compute dtype (`core.flops.PEAK_TFLOPS`, or
`profile.peak_tflops`); a device kind the table lacks (a CPU) gets no MFU.
"""

from __future__ import annotations

import dataclasses
import numbers

import jax

from semijax.core import flops as flops_lib
from semijax.core import spec as spec_lib
from semijax.errors import ConfigError
from semijax.train import metrics as metrics_lib


@dataclasses.dataclass(frozen=True)
class ProfileSpec:
  """`config.profile`.

  Attributes:
    start_step: the first step traced (1-based); 0 = no trace.
    num_steps: steps traced from there.
    peak_tflops: the peak TFLOP/s of one device for MFU; 0 = the table's for the device kind.
  """

  start_step: int = 0
  num_steps: int = 3
  peak_tflops: float = 0.0

  @classmethod
  def from_config(cls, config) -> "ProfileSpec":
    p = config.profile
    for name, minimum in (("start_step", 0), ("num_steps", 1)):
      value = p[name]
      if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ConfigError(f"config.profile.{name}: must be an integer >= {minimum}, got "
                          f"{value!r}")
    if p.start_step > config.steps:
      raise ConfigError(f"config.profile.start_step: {p.start_step} is after the run's last "
                        f"step (config.steps = {config.steps}); 0 traces nothing")
    peak = p.peak_tflops
    if isinstance(peak, bool) or not isinstance(peak, numbers.Real) or not peak >= 0:
      raise ConfigError(f"config.profile.peak_tflops: must be a number >= 0 (0: the device "
                        f"kind's table), got {peak!r}")
    return cls(int(p.start_step), int(p.num_steps), float(peak))


class Trace:
  """Starts and stops the `jax.profiler` trace around the spec's steps (see module doc)."""

  def __init__(self, spec: ProfileSpec, logdir: str):
    self.spec, self.logdir = spec, logdir
    self.active = False

  def before(self, step: int) -> None:
    """Called before 1-based `step` runs."""
    if self.spec.start_step and step == self.spec.start_step:
      jax.profiler.start_trace(self.logdir)
      self.active = True

  def after(self, step: int) -> None:
    """Called once 1-based `step` has run (and synced)."""
    if self.active and step == self.spec.start_step + self.spec.num_steps - 1:
      self.close()
      metrics_lib.say(f"profile: steps {self.spec.start_step}-{step} traced to {self.logdir}")

  def close(self) -> None:
    """Stops a trace still running (a run that ended or failed inside it)."""
    if self.active:
      self.active = False
      jax.profiler.stop_trace()


class Throughput:
  """A step's model TFLOP/s per device and MFU (see module doc).

  Args:
    model: the run's `ModelSpec` (its FLOPs and compute dtype).
    peak_tflops: `ProfileSpec.peak_tflops` (0: the table's).
  """

  def __init__(self, model: spec_lib.ModelSpec, peak_tflops: float = 0.0):
    self.flops_per_example = flops_lib.train_flops_per_example(model)
    self.devices = jax.device_count()
    self.peak = flops_lib.peak_tflops(jax.devices()[0].device_kind, peak_tflops,
                                      model.precision.dtype)

  def scalars(self, samples: int, seconds: float) -> dict:
    """{"train/tflops_per_device", and "train/mfu" where the peak is known} of a step that
    trained `samples` examples in `seconds` ({} for a step that took no measured time)."""
    if not seconds > 0:
      return {}
    tflops = self.flops_per_example * samples / seconds / self.devices / 1e12
    out = {"train/tflops_per_device": tflops}
    if self.peak is not None:
      out["train/mfu"] = tflops / self.peak
    return out
