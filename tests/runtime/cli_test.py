"""The entry-point helpers, in process (tests/train/entry_point_test.py runs the real thing)."""

import logging
import os
import sys

from absl import flags
import jax
from ml_collections import config_flags
import pytest

from semijax import errors
from semijax.runtime import cli
from semijax.train import config as config_lib

# config_flags loads config files with the deprecated importlib load_module().
pytestmark = pytest.mark.filterwarnings("ignore:the load_module:DeprecationWarning")

CONFIG_FILE = """
from semijax import errors
def get_config(arg=None):
  if arg == "gpu":
    raise errors.ConfigError("config argument: unknown option 'gpu'")
  if arg == "bug":
    raise TypeError("a bug in the config file")
  return {}
"""


def _flag_error(tmp_path, arg) -> flags.Error:
  """What absl and config_flags raise when the config file's get_config(arg) raises."""
  (tmp_path / "c.py").write_text(CONFIG_FILE)
  argv = ["prog", f"--config={tmp_path / 'c.py'}:{arg}"]
  flag_values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=flag_values, sys_argv=argv)
  with pytest.raises(flags.Error) as error:
    flag_values(argv)
  return error.value


def test_input_error_is_the_innermost_input_error(tmp_path):
  error = _flag_error(tmp_path, "gpu")
  assert "Traceback" in str(error)   # config_flags puts the traceback in the message
  assert str(cli.input_error(error)) == "config argument: unknown option 'gpu'"


def test_input_error_is_none_for_a_bug_or_a_suppressed_context(tmp_path):
  assert cli.input_error(_flag_error(tmp_path, "bug")) is None
  try:
    try:
      raise errors.ConfigError("config.x: hidden")
    except errors.ConfigError:
      raise RuntimeError("bug") from None
  except RuntimeError as e:
    assert cli.input_error(e) is None


def test_one_line_errors_exits_with_the_message_and_lets_bugs_through():
  with pytest.raises(SystemExit) as exit_info:
    with cli.one_line_errors():
      raise errors.LayoutError("config.layout.mlp: counts sum to 36")
  assert exit_info.value.code == "config.layout.mlp: counts sum to 36"
  with pytest.raises(SystemExit, match="train/loss is nan"):
    with cli.one_line_errors():
      raise FloatingPointError("train/loss is nan at step 2")
  with pytest.raises(ZeroDivisionError):
    with cli.one_line_errors():
      _ = 1 / 0


def test_missing_config_file_lists_the_files_next_to_it(tmp_path):
  (tmp_path / "a.py").write_text("")
  (tmp_path / "b.py").write_text("")
  (tmp_path / "notes.txt").write_text("")
  assert cli.missing_config_file(f"{tmp_path}/a.py:cpu") is None
  assert cli.missing_config_file(f"{tmp_path}/nope.py:cpu") == (
      f"config: no config file at '{tmp_path}/nope.py'; {tmp_path}/ has a.py, b.py")
  assert cli.missing_config_file(f"{tmp_path}/no/such.py") == (
      f"config: no config file at '{tmp_path}/no/such.py'")


def test_unknown_override_names_the_flag():
  error = AttributeError("\"'modle'\"")
  argv = ["train.py", "--config=c.py", "--config.modle.d_model=3"]
  assert cli.unknown_override(error, argv) == (
      "config.modle.d_model: unknown config key (from --config.modle.d_model=3)")
  assert cli.unknown_override(error, ["train.py", "--config.model.d_model=3"]) is None


def _record(level, pathname):
  return logging.LogRecord("absl", level, pathname, 1, "message", (), None)


def test_quiet_libraries_keeps_warnings_and_the_main_script():
  library = os.path.join(os.path.dirname(os.path.dirname(cli.__file__)), "core", "engine.py")
  orbax = "/venv/site-packages/orbax/checkpoint/checkpoint_manager.py"
  main = getattr(sys.modules["__main__"], "__file__", None) or "/no/main.py"
  assert not cli.quiet_libraries(_record(logging.INFO, library))
  assert not cli.quiet_libraries(_record(logging.INFO, orbax))
  assert cli.quiet_libraries(_record(logging.WARNING, orbax))
  assert cli.quiet_libraries(_record(logging.INFO, main)) == (main != "/no/main.py")


def test_default_cache_dir_follows_xdg(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert cli.default_cache_dir() == str(tmp_path / "semijax" / "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert cli.default_cache_dir() == os.path.expanduser("~/.cache/semijax/jax")


def test_cache_dir_prefers_the_flag_then_jaxs_own_setting():
  assert cli.cache_dir("/from/flag") == "/from/flag"
  assert jax.config.jax_compilation_cache_dir   # set by conftest (and JAX_COMPILATION_CACHE_DIR)
  assert cli.cache_dir(None) == jax.config.jax_compilation_cache_dir
  assert os.environ["JAX_COMPILATION_CACHE_DIR"] == jax.config.jax_compilation_cache_dir


def test_cache_flags_for_children_pass_the_resolved_directory_or_turn_the_cache_off():
  class Holder:                      # what absl's FlagHolder offers: .value
    def __init__(self, value):
      self.value = value
  args, resolved = cli.cache_flags_for_children(Holder(True), Holder("/from/flag"))
  assert (args, resolved) == (["--compilation_cache=True", "--compilation_cache_dir=/from/flag"],
                              "/from/flag")
  args, resolved = cli.cache_flags_for_children(Holder(True), Holder(None))
  assert resolved == jax.config.jax_compilation_cache_dir     # JAX's own setting, spelled out
  assert args[-1] == f"--compilation_cache_dir={resolved}"
  assert cli.cache_flags_for_children(Holder(False), Holder("/from/flag")) == (
      ["--compilation_cache=False"], None)


def test_a_config_file_that_is_not_python_is_one_line_naming_it(tmp_path):
  (tmp_path / "garbage.py").write_bytes(b"\x7fELF\x00\x01\xff")
  with pytest.raises(errors.ConfigError, match=r"^config: '.*garbage\.py' is not a Python config file: "
                     r"source code string cannot contain null bytes$"):
    config_lib.load(str(tmp_path / "garbage.py"))
