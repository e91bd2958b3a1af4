"""What an absl entry point (experiments/train.py) needs around its `main`.

  * `parse_flags`, for app.run(main, flags_parser=cli.parse_flags): absl's flag parsing, except
    that bad input in --config ends in one line: a missing config file, one that is not Python
    (binary garbage, a syntax error), an error the config file raises (an unknown option after
    the colon), an unknown --config.<key> override. config_flags
    loads the config file while the flags are parsed, so these fail before `main`. It also hides
    the libraries' INFO logs unless --verbosity is given (see `quiet_libraries`).
  * `one_line_errors()`, around the body of `main`: an `errors.InputError` (bad input the user can
    fix) or a FloatingPointError (a NaN loss) ends the program with its message as one line on
    stderr and exit status 1. Anything else is a bug and keeps its traceback.
  * `define_cache_flags()` and `apply_cache_flags(...)`: --compilation_cache (default on) and
    --compilation_cache_dir: JAX's persistent compilation cache for every program, so that a
    rerun of the same setup loads its programs instead of compiling them;
    `cache_flags_for_children(...)` hands the same cache to the processes an entry point starts.
"""

from __future__ import annotations

import contextlib
import logging as std_logging
import os
import re
import sys
from typing import Iterator

from absl import flags, logging
import jax

from semijax import errors

def default_cache_dir() -> str:
  """$XDG_CACHE_HOME/semijax/jax, or ~/.cache/semijax/jax."""
  cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(cache_home, "semijax", "jax")


def cache_dir(flag_value: str | None) -> str:
  """`flag_value` if set, else JAX's own setting (JAX_COMPILATION_CACHE_DIR in the environment or
  --jax_compilation_cache_dir), else `default_cache_dir()`."""
  return flag_value or jax.config.jax_compilation_cache_dir or default_cache_dir()


def use_compilation_cache(directory: str) -> None:
  """JAX's persistent compilation cache in `directory`, for every program however fast.

  (JAX never writes a program that calls back to the host; semijax's steps have no callback.)
  """
  jax.config.update("jax_compilation_cache_dir", directory)
  # Most of our programs compile in under JAX's default threshold of 1 s, which skips them.
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


def define_cache_flags():
  """Defines --compilation_cache and --compilation_cache_dir (for an entry point's module level);
  returns their holders for `apply_cache_flags`."""
  return (flags.DEFINE_bool("compilation_cache", True,
                            "Keep compiled programs in --compilation_cache_dir for later runs."),
          flags.DEFINE_string("compilation_cache_dir", None, "JAX's persistent compilation cache;"
                              f" default: $JAX_COMPILATION_CACHE_DIR if set, else "
                              f"{default_cache_dir()}."))


def apply_cache_flags(cache, directory) -> None:
  """Turns the persistent compilation cache on as the flags of `define_cache_flags` say."""
  if cache.value:
    use_compilation_cache(cache_dir(directory.value))


def cache_flags_for_children(cache, directory) -> tuple[list[str], str | None]:
  """The flags that give a child process the cache of `define_cache_flags`' holders as this one
  resolves them (however the flags named it), and that cache's directory (None: cache off)."""
  resolved = cache_dir(directory.value) if cache.value else None
  args = [f"--compilation_cache={cache.value}"]
  if resolved:
    args.append(f"--compilation_cache_dir={resolved}")
  return args, resolved


@contextlib.contextmanager
def one_line_errors() -> Iterator[None]:
  """Bad input or a NaN loss: exits with the message (it names the field) and no traceback."""
  try:
    yield
  except (errors.InputError, FloatingPointError) as e:
    sys.exit(str(e))


def parse_flags(argv: list[str]) -> list[str]:
  """absl's flag parsing (flags.FLAGS(argv)); bad input in --config exits with one line."""
  spec = _config_spec(argv)
  if spec is not None and (message := missing_config_file(spec)) is not None:
    sys.exit(message)
  try:
    argv = flags.FLAGS(argv)
  except flags.Error as e:
    if (cause := input_error(e)) is not None:   # raised by the config file's get_config
      sys.exit(str(cause))
    # "flag --config.steps=x: ...": an override's value (its parse may raise a SyntaxError,
    # which is not the config file's), else the config file, else "flag --num_processes=x"
    # (or a config file's traceback: a bug)
    sys.exit(wrong_type(str(e)) or unreadable_config(e, spec) or str(e))
  except SyntaxError as e:                  # compiling the config file
    sys.exit(unreadable_config(e, spec))
  except (AttributeError, KeyError) as e:   # parsing a --config.<unknown>=... override
    if (message := unknown_override(e, argv)) is None:
      raise
    sys.exit(message)
  if flags.FLAGS["verbosity"].using_default_value:
    logging.get_absl_handler().addFilter(quiet_libraries)
  return argv


def _config_spec(argv: list[str]) -> str | None:
  """The value of --config in `argv` ("configs/gpt_tiny.py:cpu"), found as absl would."""
  probe = flags.FlagValues()
  flags.DEFINE_string("config", None, "", flag_values=probe)
  try:
    probe(argv, known_only=True)
  except flags.Error:
    return None
  return probe["config"].value


def missing_config_file(spec: str) -> str | None:
  """A message naming the config files next to it if the file part of `spec` is not a file."""
  path = spec.split(":", 1)[0]
  if os.path.isfile(path):
    return None
  folder = os.path.dirname(path) or "."
  known = sorted(n for n in os.listdir(folder) if n.endswith(".py")) if os.path.isdir(
      folder) else []
  return (f"config: no config file at {path!r}" +
          (f"; {os.path.join(folder, '')} has {', '.join(known)}" if known else ""))


def unreadable_config(error: BaseException | None, spec: str | None) -> str | None:
  """A line naming the config file if `error` was raised from compiling it (not Python source:
  binary garbage, a syntax error), else None."""
  seen = set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, SyntaxError):
      path = (spec or "").split(":", 1)[0] or error.filename
      where = f" (line {error.lineno})" if error.lineno else ""
      return f"config: {path!r} is not a Python config file: {error.msg}{where}"
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
  return None


def input_error(error: BaseException | None) -> errors.InputError | None:
  """The innermost InputError that `error` was raised from (absl and config_flags wrap it)."""
  found, seen = None, set()
  while error is not None and id(error) not in seen:
    seen.add(id(error))
    if isinstance(error, errors.InputError):
      found = error
    error = error.__cause__ or (None if error.__suppress_context__ else error.__context__)
  return found


_KINDS = ((r"for int\(\)", "an integer"), (r"to float", "a number"),
          (r"[Bb]oolean", "true or false"),
          (r"as tuple", "a tuple: one value, or several quoted, e.g. \"('a', 'b')\""))


def wrong_type(message: str) -> str | None:
  """"config.steps: expected an integer, got 'abc'" for absl's message about a --config.<key>
  override of the wrong type ("flag --config.steps=abc: invalid literal for int() ...")."""
  found = re.match(r"flag --(config\.[\w.]+)=(.*?): (.*)$", message, re.S)
  if found is None:
    return None
  name, value, reason = found.groups()
  for pattern, kind in _KINDS:
    if re.search(pattern, reason):
      return f"{name}: expected {kind}, got {value!r}"
  return f"{name}: {reason.strip()} (from --{name}={value})"


def unknown_override(error: Exception, argv: list[str]) -> str | None:
  """A clear message for a --config.<key> override that the locked config does not have."""
  found = re.search(r"'([A-Za-z0-9_]+)", str(error))
  hint = re.search(r'Did you mean "[^"]*" instead of "[^"]*"\?', str(error))
  for arg in argv[1:]:
    name = arg.split("=")[0]
    if found and name.startswith("--config.") and found.group(1) in name.split(".")[1:]:
      return (f"{name[2:]}: unknown config key (from {arg})" +
              (f"; {hint.group(0)}" if hint else ""))
  return None


def quiet_libraries(record: std_logging.LogRecord) -> bool:
  """Keeps warnings and the main script's lines; drops the libraries' INFO (Orbax's, and
  semijax's own: the training loop prints what a user needs to the console)."""
  main_file = getattr(sys.modules.get("__main__"), "__file__", None)
  return record.levelno >= std_logging.WARNING or record.pathname == main_file
