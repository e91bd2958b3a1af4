r"""Train a semijax model from an ml_collections config.

This file is intentionally short: the loop lives in `semijax.train.train_and_evaluate`, so tests
and notebooks call the same code.

  python experiments/train.py --config configs/gpt_tiny.py:cpu --workdir /tmp/gpt_tiny \
      --config.steps=50 --config.hetero.slowdown='(1,1,1,4,1,1,1,1)'

On a CPU host, emulate 8 devices with XLA_FLAGS=--xla_force_host_platform_device_count=8.
Several processes (or hosts): add --coordinator_address=host:port --num_processes=N
--process_id=i to each (or --distributed_auto on SLURM / Cloud TPU).

Bad input (a setting, a config file or its options, a data file) ends the run before anything
is compiled or written, with one line on stderr that starts with the field ("config.layout.mlp:
...") and a non-zero exit; so does a NaN loss. Anything else is a bug and keeps its traceback
(semijax.runtime.cli).

Compiled programs are kept in JAX's persistent compilation cache, by default in
$JAX_COMPILATION_CACHE_DIR if set, else $XDG_CACHE_HOME/semijax/jax (~/.cache/semijax/jax), so a
rerun of the same setup loads them instead of compiling; --compilation_cache_dir=DIR moves it,
--nocompilation_cache turns it off.

The console shows where the run starts, the warm-up, balancing changes, progress lines, a summary
and every warning; the libraries' INFO logs (semijax's and Orbax's) are hidden. --verbosity=0
shows them too, --verbosity=-1 shows warnings only.
"""

import faulthandler
import signal

from absl import app, flags, logging
import jax
from ml_collections import config_flags

from semijax.runtime import cli
from semijax.runtime import distributed
from semijax.train import loop as train

_CONFIG = config_flags.DEFINE_config_file("config", None, "Training configuration file.",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "Work directory (checkpoints, metrics).")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Processes in the job.")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index.")
_AUTO = flags.DEFINE_bool("distributed_auto", False, "Let JAX detect the cluster (SLURM, TPU).")
_CACHE, _CACHE_DIR = cli.define_cache_flags()
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError("Too many command-line arguments.")
  faulthandler.register(signal.SIGUSR1, all_threads=True)   # the launcher's ask on a timeout
  with cli.one_line_errors():
    # Before anything touches a JAX backend.
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           auto=_AUTO.value)
    # A rerun of the same setup then loads its programs instead of compiling them.
    cli.apply_cache_flags(_CACHE, _CACHE_DIR)
    logging.info("process %d of %d, %d devices (%d local)", jax.process_index(),
                 jax.process_count(), jax.device_count(), jax.local_device_count())
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)


if __name__ == "__main__":
  jax.config.config_with_absl()   # lets --jax_* flags through
  app.run(main, flags_parser=cli.parse_flags)
