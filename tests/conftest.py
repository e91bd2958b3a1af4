"""Eight fake CPU devices for every test (set before jax is imported)."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests check semantics, not speed: skip most XLA optimization passes to compile faster (as the
# flax examples' tests do). Set in the environment, so that the processes tests start (the
# entry points, the two-process runs, the notebook) compile the same way: those took about a
# fifth less time than with full optimization.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "true")

import tempfile  # noqa: E402

import jax  # noqa: E402

# Engines are rebuilt per test, so identical programs (inits, packers, reference models) would
# compile again; the persistent cache, keyed by the program, shares them within the session.
# The environment variable also sends the programs of experiments/train.py subprocesses there,
# not to the user's ~/.cache.
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="semijax-jit-")
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
