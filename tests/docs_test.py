"""The commands that README.md and docs/*.md give as runnable run as written.

A fenced block whose info string is `bash` is runnable; every other fence (`text`, `python`, ...)
is not checked. In a runnable block each command must be one this test knows: an entry point
(`python experiments/<name>.py ...`, through `python -m semijax.runtime.launch ... -- ...` too,
or `./scripts/demo.sh ...`), whose flags and `--config.<field>` overrides are parsed by absl as
the entry point would and whose training config is validated (`doc_commands.py`); a script of
`scripts/` that exists; or a setup command (`export`, `source`, `cd`, `pip`, ...). An `export`
holds for the rest of its block (the device count in XLA_FLAGS, times the processes, is what the
config is validated against; none given: not checked). The pages' relative links must point at
files and headings that exist, and the README stays short.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from helpers import ROOT
from semijax.runtime import launch

PAGES = ["README.md"] + sorted(os.path.relpath(p, ROOT)
                               for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
SETUP = {"export", "source", "cd", "pip", "pip3", "git", "mkdir", "ls", "cat", "rm", "cp", "mv",
         "tensorboard", "nvidia-smi", "jupyter", "wget", "curl", "tar", "head", "tail", "sleep",
         "kill", "wait", "echo", "srun", "sbatch", "du", "df", "time", "python3", "env"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
DEVICES = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


def blocks(page: str) -> list[tuple[int, str]]:
  """(first line number, text) of every fenced `bash` block of `page`."""
  found, info, lines, start = [], None, [], 0
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    for number, line in enumerate(f, 1):
      fence = re.match(r"\s*```(\S*)", line)
      if fence and info is None:
        info, lines, start = fence.group(1), [], number + 1
      elif fence:
        if info == "bash":
          found.append((start, "".join(lines)))
        info = None
      elif info is not None:
        lines.append(line)
  return found


def commands(page: str) -> list[tuple[str, list[str], dict]]:
  """(where, tokens, environment) of every command in `page`'s runnable blocks, in order; the
  environment holds what earlier `export`s of its block and the command's own prefix set."""
  found = []
  for start, text in blocks(page):
    exported = {}
    for offset, line in enumerate(re.sub(r"\\\n", " ", text).splitlines()):
      tokens = shlex.split(line, comments=True)
      while tokens:
        cut = next((i for i, t in enumerate(tokens) if t in SEPARATORS), len(tokens))
        command, tokens = tokens[:cut], tokens[cut + 1:]
        env = dict(exported)
        while command and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", command[0]):
          key, value = command.pop(0).split("=", 1)
          env[key] = value
        if command[:1] == ["export"]:
          exported.update(a.split("=", 1) for a in command[1:] if "=" in a)
        if command:
          where = f"{page}:{start + offset}"
          same_line = sum(w.split("#")[0] == where for w, _, _ in found)
          found.append((where + (f"#{same_line + 1}" if same_line else ""), command, env))
  return found


def job(command: list[str], env: dict) -> dict | str:
  """The entry-point check `doc_commands.py` runs for `command`, or "" if it has none, or why
  the command is not one this test accepts."""
  name = command[0]
  if name in {"python", "python3"} and command[1:2] == ["-m"]:
    module = command[2] if len(command) > 2 else ""
    if module == "semijax.runtime.launch":
      try:
        parsed = launch.parser().parse_args(command[3:])
      except SystemExit:
        return f"python -m semijax.runtime.launch does not take {command[3:]}"
      inner = parsed.command[1:] if parsed.command[:1] == ["--"] else parsed.command
      found = job(inner, dict(env, JAX_PLATFORMS="cpu"))
      if isinstance(found, dict):
        found.update(devices=parsed.num_processes * parsed.devices_per_process,
                     processes=parsed.num_processes)
      return found
    return "" if module in {"pip", "pytest", "venv"} else f"unknown module {module!r}"
  if name in {"python", "python3"} and len(command) > 1 and command[1].endswith(".py"):
    script = os.path.normpath(command[1])
    if not os.path.isfile(os.path.join(ROOT, script)):
      return f"no script {script}"
    local = None if "--distributed_auto" in command else DEVICES.search(env.get("XLA_FLAGS", ""))
    given = [a.split("=", 1)[1] for a in command if a.startswith("--num_processes=")]
    processes = int((given or [env.get("SEMIJAX_NUM_PROCESSES", "1")])[-1])
    return {"script": script, "argv": command[2:], "processes": processes,
            "devices": int(local.group(1)) * processes if local else None}
  if name.startswith("./scripts/") or name.startswith("scripts/"):
    if not os.path.isfile(os.path.join(ROOT, name)):
      return f"no script {name}"
    if name.endswith("demo.sh"):
      return {"script": "experiments/demo.py", "argv": command[1:], "processes": 1,
              "devices": 8}
    return ""
  if name in SETUP:
    return ""
  return f"{name!r} is not a command this check knows (use a `text` fence for it)"


CASES = [(where, command, env) for page in PAGES for where, command, env in commands(page)]


@functools.cache
def entry_point_results() -> dict:
  """{where: None | error} for every entry-point command of CASES, from one subprocess."""
  jobs = []
  for where, command, env in CASES:
    found = job(command, env)
    if isinstance(found, dict):
      jobs.append(dict(found, key=where))
  result = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "doc_commands.py")],
                          input=json.dumps(jobs), capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert result.returncode == 0, result.stderr[-3000:]
  return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_pages_have_runnable_commands():
  """The check sees the README's commands (a change of the fence convention would hide them)."""
  readme = [c for where, c, _ in CASES if where.startswith("README.md")]
  assert ["./scripts/demo.sh"] in readme and ["./scripts/test.sh"] in readme
  assert any(c[:2] == ["python", "experiments/train.py"] for c in readme)


@pytest.mark.parametrize("where, command, env", CASES, ids=[c[0] for c in CASES])
def test_command_runs_as_written(where, command, env):
  found = job(command, env)
  assert isinstance(found, dict) or found == "", f"{where}: {found}"
  if isinstance(found, dict):
    assert entry_point_results()[where] is None, f"{where}: {shlex.join(command)}: " + (
        entry_point_results()[where])


def slugs(page: str) -> set[str]:
  """The anchors of `page`'s headings, as GitHub makes them."""
  with open(page, encoding="utf-8") as f:
    headings = re.findall(r"^#+\s+(.*?)\s*$", f.read(), re.M)
  return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_point_at_files_and_headings(page):
  text = open(os.path.join(ROOT, page), encoding="utf-8").read()
  folder = os.path.dirname(os.path.join(ROOT, page))
  for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", text):
    if re.match(r"^[a-z]+:", target):
      continue
    path = os.path.join(folder, target) if target else os.path.join(ROOT, page)
    assert os.path.exists(path), f"{page}: broken link {target}"
    if anchor and path.endswith(".md"):
      assert anchor in slugs(path), f"{page}: no heading for {target}#{anchor}"


def test_readme_is_short():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    assert len(f.readlines()) <= 250
