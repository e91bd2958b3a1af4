r"""Train a semijax model from an ml_collections config.

This file is intentionally short: the loop lives in `semijax.train.train_and_evaluate`, so tests
and notebooks call the same code.

  python experiments/train.py --config configs/gpt_tiny.py:cpu --workdir /tmp/gpt_tiny \
      --config.steps=50 --config.hetero.slowdown='(1,1,1,4,1,1,1,1)'

On a CPU host, emulate 8 devices with XLA_FLAGS=--xla_force_host_platform_device_count=8.
Several processes (or hosts): add --coordinator_address=host:port --num_processes=N
--process_id=i to each (or --distributed_auto on SLURM / Cloud TPU).
"""

import re
import sys

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from semijax.runtime import distributed
from semijax.train import loop as train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training configuration file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory (checkpoints, metrics).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_AUTO = flags.DEFINE_bool("distributed_auto", False, "Let JAX detect the cluster (SLURM, TPU).")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  # Before anything touches a JAX backend.
  distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                         auto=_AUTO.value)
  logging.info("process %d of %d, %d devices (%d local)", jax.process_index(),
               jax.process_count(), jax.device_count(), jax.local_device_count())
  train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


def _unknown_override(error: Exception) -> str | None:
  """A clear message for a --config.<key> override that the locked config does not have."""
  found = re.search(r"'([A-Za-z0-9_]+)", str(error))
  hint = re.search(r'Did you mean "[^"]*" instead of "[^"]*"\?', str(error))
  for arg in sys.argv[1:]:
    name = arg.split("=")[0]
    if found and name.startswith("--config.") and found.group(1) in name.split(".")[1:]:
      return (f"{name[2:]}: unknown config key (from {arg})" +
              (f"; {hint.group(0)}" if hint else ""))
  return None


if __name__ == "__main__":
  jax.config.config_with_absl()   # lets --jax_* flags through
  try:
    app.run(main)
  except (AttributeError, KeyError) as e:   # parsing a --config.<unknown>=... override
    if (message := _unknown_override(e)) is None:
      raise
    sys.exit(message)
