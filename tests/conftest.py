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

import atexit  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

import jax  # noqa: E402
import pytest  # noqa: E402

# Engines are rebuilt per test, so identical programs (inits, packers, reference models) would
# compile again; the persistent cache, keyed by the program, shares them within the session.
# The environment variable also sends the programs of experiments/train.py subprocesses there,
# not to the user's ~/.cache.
os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="semijax-jit-")
atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Frees a test file's compiled programs when it ends. XLA:CPU maps each loaded executable's
  code into memory regions of its own; a worker that kept every program of its files held about
  46,000 of them by the end of the suite, near Linux's default limit of 65,530 per process
  (vm.max_map_count), past which LLVM fails to compile with "Cannot allocate memory". Cleared,
  a worker fell back to about 650 after each file measured; the next file's programs still load
  from the persistent cache. A module's own globals (an engine it shares) keep theirs."""
  yield
  jax.clear_caches()
  gc.collect()


# scripts/test.sh reruns, after a crashed worker or a hung run, only the tests that did not pass:
# the first run records the node ids of the tests that passed or were skipped (one a line, written
# by the process that reports, the xdist controller), the rerun deselects them.
_DONE_LOG = os.environ.get("SEMIJAX_TESTS_DONE_LOG")
_SKIP_DONE = os.environ.get("SEMIJAX_TESTS_SKIP_DONE")


def pytest_runtest_logreport(report):
  if not _DONE_LOG or "PYTEST_XDIST_WORKER" in os.environ:
    return
  if report.skipped or (report.when == "call" and report.passed):
    with open(_DONE_LOG, "a") as f:
      f.write(report.nodeid + "\n")


# The files that take a minute or more of a worker (measured on 2 cores, longest first): they
# are handed out first (pytest-xdist's --dist=loadfile follows the collection order), so that
# the workers end together on short files instead of one running a long file alone at the end.
_LONG_FILES = ("sync/real_test.py", "train/loop_test.py", "core/resize_test.py",
               "benchmarks/notebook_test.py", "core/loss_scale_test.py", "models/llama_test.py",
               "runtime/multiprocess_test.py", "core/pipeline_test.py", "models/model_test.py",
               "train/train_test.py", "balance/balance_test.py", "sim/calibration_test.py",
               "train/pipelined_replicas_test.py", "runtime/launch_test.py",
               "train/llama_config_test.py")


def _long_first(item) -> int:
  path = item.nodeid.split("::")[0].removeprefix("tests/")
  return _LONG_FILES.index(path) if path in _LONG_FILES else len(_LONG_FILES)


def pytest_collection_modifyitems(config, items):
  items.sort(key=_long_first)        # stable: the other files, and every file's tests, in order
  if not _SKIP_DONE:
    return
  with open(_SKIP_DONE) as f:
    done = set(f.read().split("\n"))
  keep = [item for item in items if item.nodeid not in done]
  config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
  items[:] = keep
