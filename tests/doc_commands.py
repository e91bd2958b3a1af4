"""Checks entry-point command lines the way the entry points themselves would parse them.

Run as a subprocess by `docs_test.py` (absl keeps its flags in one global registry, which every
entry point fills at import): reads a JSON list of jobs on stdin,

  {"key": ..., "script": "experiments/train.py", "argv": [...], "devices": 8 | null,
   "processes": 1}

and prints one JSON object {key: null | "what is wrong"}. For each job it imports the script as
a module (its `main` does not run), parses `argv` with absl exactly as `app.run` would (unknown
flags, values of the wrong type, a config file that fails to load or an override of a field it
does not have all raise), validates the resulting config for `experiments/train.py` against the
given device and process counts, then removes the script's flags for the next job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

from absl import flags
from absl import logging  # noqa: F401  (defines --verbosity and the other logging flags)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELP = {"--help", "--helpfull", "--helpshort", "--helpxml", "-h"}


def check(index: int, job: dict) -> str | None:
  """None if `job`'s command line parses (and, for train.py, validates); else why not."""
  from semijax.train import config as config_lib   # noqa: PLC0415  (after sys.path is set)

  path = os.path.join(ROOT, job["script"])
  before = set(flags.FLAGS)
  try:
    spec = importlib.util.spec_from_file_location(f"_doc_script_{index}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # config_flags reads the --config.<field> overrides from sys.argv.
    sys.argv = [path] + [a for a in job["argv"] if a not in HELP]
    flags.FLAGS(sys.argv)
    if job["script"] == "experiments/train.py":
      config_lib.validate(flags.FLAGS.config, job["devices"], job["processes"])
    return None
  except BaseException as e:   # noqa: BLE001  (SystemExit from a config file included)
    return f"{type(e).__name__}: {e}"
  finally:
    flags.FLAGS.unparse_flags()
    for name in set(flags.FLAGS) - before:
      delattr(flags.FLAGS, name)


def main() -> None:
  sys.path[:0] = [ROOT]
  os.chdir(ROOT)
  jobs = json.load(sys.stdin)
  print(json.dumps({job["key"]: check(i, job) for i, job in enumerate(jobs)}))


if __name__ == "__main__":
  main()
