"""experiments/train.py as a user runs it: bad input ends in one line naming the field.

Every case is a subprocess (importing jax costs seconds); the module fixture starts them all at
once and waits, so the file takes about as long as its slowest run.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys

import pytest

from helpers import ROOT

GPT = "configs/gpt_tiny.py:cpu"
SMALL = ("--config.model.num_layers=1", "--config.layout.num_widths=1")   # quicker to compile


@dataclasses.dataclass(frozen=True)
class Case:
  args: tuple[str, ...]
  last_line: str | None          # regex the last stderr line must match; None: the run succeeds
  config: str = GPT
  refused_early: bool = True     # refused before anything is compiled or written


CASES = {
    "config_option": Case((), r"config\b.*unknown option 'gpu'", config="configs/gpt_tiny.py:gpu"),
    "config_file": Case((), r"config: no config file at 'configs/nope\.py'; configs/ has "
                        r"gpt_gpu\.py, gpt_harmony\.py, gpt_tiny\.py, llama_tiny\.py, "
                        r"vit_digits\.py$",
                        config="configs/nope.py"),
    "config_file_with_override": Case(("--config.steps=3",), r"config: no config file at ",
                                      config="configs/nope.py"),
    "config_garbage": Case((), r"config: '.*garbage\.py' is not a Python config file: source "
                           r"code string cannot contain null bytes$", config="{garbage}"),
    "config_syntax": Case((), r"config: '.*syntax\.py' is not a Python config file: invalid "
                          r"syntax \(line 1\)$", config="{syntax}:cpu"),
    "override_key": Case(("--config.modle.d_model=3",), re.escape(
        "config.modle.d_model: unknown config key (from --config.modle.d_model=3)")),
    "override_value": Case(("--config.steps=abc",),
                           re.escape("config.steps: expected an integer, got 'abc'") + "$"),
    "override_bool": Case(("--config.balance.fit_repeat=maybe",),
                          re.escape("config.balance.fit_repeat: expected true or false, got "
                                    "'maybe'") + "$"),
    # A tuple override whose parse fails with a SyntaxError ("1f1b" is no number): the value
    # is wrong, not the config file.
    "override_tuple": Case(("--config.planner.schedules=gpipe,1f1b",), re.escape(
        "config.planner.schedules: expected a tuple: one value, or several quoted, e.g. "
        "\"('a', 'b')\", got 'gpipe,1f1b'") + "$"),
    "processes": Case(("--num_processes=2",), r"--num_processes: 2 processes need "
                      r"--coordinator_address"),
    "nan_loss": Case(("--config.steps=3", "--config.optimizer.learning_rate=1e30",
                      "--config.optimizer.warmup_steps=0") + SMALL,
                     r"train/loss is nan at step \d: training stopped\. ", refused_early=False),
    # Need the validation changes in semijax/train/config.py:
    "straggler_int": Case(("--config.resize.straggler=3", "--config.steps=1") + SMALL, None),
    "slowdown_nan": Case(("--config.hetero.slowdown=(1,nan,1,1,1,1,1,1)",),
                         r"config\.hetero\.slowdown: .*positive finite"),
    "vit_patch_size": Case(("--config.model.patch_size=3",), r"config\.model\.patch_size: ",
                           config="configs/vit_digits.py:cpu"),
}


@dataclasses.dataclass(frozen=True)
class Run:
  returncode: int
  stdout: str
  stderr: str
  workdir: str
  cache: str


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Run]:
  """Runs every case of CASES at once; {name: Run}."""
  root = tmp_path_factory.mktemp("entry_point")
  files = {"garbage": root / "garbage.py", "syntax": root / "syntax.py"}
  files["garbage"].write_bytes(b"\x7fELF\x00\x01\xff garbage")
  files["syntax"].write_text("def get_config(:\n")
  started = {}
  for name, case in CASES.items():
    workdir, cache = root / name / "workdir", root / name / "cache"
    out, err = open(root / f"{name}.out", "w+"), open(root / f"{name}.err", "w+")
    command = [sys.executable, os.path.join("experiments", "train.py"), "--config",
               case.config.format(**files),
               "--workdir", str(workdir), f"--compilation_cache_dir={cache}", *case.args]
    started[name] = (subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=err), out, err,
                     workdir, cache)
  done = {}
  for name, (process, out, err, workdir, cache) in started.items():
    try:
      process.wait(timeout=300)
    except subprocess.TimeoutExpired:
      process.kill()
      process.wait()
    texts = []
    for f in (out, err):
      f.seek(0)
      texts.append(f.read())
      f.close()
    done[name] = Run(process.returncode, *texts, str(workdir), str(cache))
  return done


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.last_line is not None])
def test_bad_input_ends_in_one_line_naming_the_field(runs, name):
  case, run = CASES[name], runs[name]
  lines = run.stderr.strip().splitlines() or [""]
  assert run.returncode != 0, run.stderr
  assert "Traceback" not in run.stderr, run.stderr
  assert re.match(case.last_line, lines[-1]), run.stderr
  if case.refused_early:
    assert not os.path.exists(run.workdir)   # nothing written ...
    assert not os.path.exists(run.cache)     # ... nor compiled (every program would be cached)


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.last_line is None])
def test_good_input_trains(runs, name):
  run = runs[name]
  assert run.returncode == 0, run.stderr
  assert re.search(r"\bstep 1/1\b", run.stdout), run.stdout
  assert os.path.exists(os.path.join(run.workdir, "metrics.jsonl"))
  assert os.listdir(run.cache)   # the compiled programs, for the next run


def test_rerunning_a_finished_run_says_so_without_compiling(runs, tmp_path):
  """The same command again: exit 0, one line saying there is nothing to train, no program
  compiled (a fresh cache stays empty) and the workdir unchanged."""
  first = runs["straggler_int"]
  case = CASES["straggler_int"]
  metrics = os.path.join(first.workdir, "metrics.jsonl")
  before = open(metrics).read(), sorted(os.listdir(os.path.join(first.workdir, "checkpoints")))
  cache = tmp_path / "cache"
  again = subprocess.run(
      [sys.executable, os.path.join("experiments", "train.py"), "--config", case.config,
       "--workdir", first.workdir, f"--compilation_cache_dir={cache}", *case.args],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert again.returncode == 0, again.stderr
  assert re.search(r"nothing to train: the checkpoint \S+/checkpoints/1 has trained 1 steps, "
                   r"config\.steps is 1, "
                   r"val_loss \d+\.\d+; raise --config\.steps to train on", again.stdout), (
                       again.stdout)
  assert "warm-up" not in again.stdout and "done:" not in again.stdout
  assert not cache.exists() or not os.listdir(cache)
  after = open(metrics).read(), sorted(os.listdir(os.path.join(first.workdir, "checkpoints")))
  assert after == before
