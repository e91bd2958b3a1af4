"""The parts of a run's balancer, built from its typed config.

`build` makes what `coordinator.Balancer.create` wires together: the policy
(`policies.make`) and its buckets for the configured layout, the priority and its `Resizer` for
policies that resize, and for controlled policies the cost model (`cost_model`), the
`controller.Controller`, the shared `sampling.SpeedSampler` and, in process 0 with a workdir,
the decision log.
"""

from __future__ import annotations

import jax

from semijax.balance import buckets as buckets_lib
from semijax.balance import controller as controller_lib
from semijax.balance import cost as cost_lib
from semijax.balance import decisions as decisions_lib
from semijax.balance import policies as policies_lib
from semijax.balance import priority as priority_lib
from semijax.balance import probe as probe_lib
from semijax.balance import sampling as sampling_lib
from semijax.core import plan as plan_lib


def cost_model(engine, spec, settings, resize_spec, buckets) -> cost_lib.CostModel:
  """The cost model of a controlled run: FLOPs from the model spec, widths of the big bucket."""
  narrow = plan_lib.uniform_widths(buckets.start)
  return cost_lib.CostModel(
      spec.flops_per_unit(), {k: u.widths for k, u in buckets.big.kinds().items()},
      engine.num_units, fixed_fraction=settings.fixed_fraction,
      repeat=settings.repeat_share, fit_repeat=settings.fit_repeat, alpha=settings.cost_alpha,
      memory=settings.cost_memory, narrow=None if narrow is None else {
          k: w[0] for k, w in narrow.items()},
      resize_mode=resize_spec.mode, fractions=resize_spec.fractions,
      gemm_flops=spec.gemm_flops_per_unit())


def build(engine, *, settings, resize_spec, hetero, spec, layout, workdir: str | None,
          steps_per_epoch: int, seed: int, tokens: int) -> dict:
  """The parts of the balancer a run's typed config asks for (see module doc).

  Args:
    engine: the run's engine; settings: `BalanceSettings`; resize_spec: `resize.ResizeSpec`;
    hetero: `core.emulation.Hetero`; spec: `core.spec.ModelSpec`; layout: the configured
    layout; workdir: where decisions.jsonl goes (process 0), or None; steps_per_epoch: steps
    per pass over the data (default epoch of resizing); seed: for the random priority;
    tokens: the tokens one tensor group computes in a step (a model-shaped probe's rows).

  Returns:
    {"policy", "buckets", "resizer", "controller", "sampler", "log"}: the `coordinator.Balancer`
    arguments of those names (resizer, controller, sampler and log may be None).
  """
  epoch_steps = resize_spec.epoch_steps or steps_per_epoch
  policy = policies_lib.make(settings, resize_spec, epoch_steps)
  buckets = policy.buckets(layout)
  resizer = None
  if policy.resizes:
    priority = priority_lib.Priority(
        resize_spec, num_layers=spec.num_layers, d_model=spec.d_model,
        num_units=engine.num_units, unit_sizes=engine.unit_sizes,
        num_devices=layout.num_devices, seed=seed, compiled=engine.helper_programs)
    resizer = priority_lib.Resizer(priority, resize_spec.refresh_every or epoch_steps)
  controller = sampler = log = None
  if policy.controlled:
    cost = cost_model(engine, spec, settings, resize_spec, buckets)
    controller = controller_lib.Controller(
        policy, settings, cost, policy.initial_setup(buckets.start),
        buckets_lib.capacities(buckets.big), engine.unit_bytes())
    block = probe_lib.ProbeShape.of_block(spec, tokens, layout.num_devices)
    sampler = sampling_lib.SpeedSampler(settings, hetero, engine.mesh, block)
    if workdir is not None and jax.process_index() == 0:
      log = decisions_lib.DecisionLog(workdir)
  return {"policy": policy, "buckets": buckets, "resizer": resizer, "controller": controller,
          "sampler": sampler, "log": log}
