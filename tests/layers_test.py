"""The package's shape is checked, not hoped for: the import-layer contract in setup.cfg holds,
and no module hides an import of the project inside a function (the way to dodge a cycle)."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from helpers import ROOT

PACKAGES = ("semijax", "benchmarks")


def lint_imports(root=ROOT, env=None):
  """`lint-imports` with the contract in `root`/setup.cfg, run in `root`."""
  exe = shutil.which("lint-imports") or os.path.join(os.path.dirname(sys.executable),
                                                     "lint-imports")
  return subprocess.run([exe, "--config", "setup.cfg"], cwd=root, capture_output=True, text=True,
                        timeout=120, env=env)


def test_import_layer_contract_holds():
  out = lint_imports()
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "0 broken" in out.stdout and "3 kept" in out.stdout


def _hidden_imports(path: pathlib.Path) -> list[str]:
  """`file:line module` of every import of the project's packages inside a function."""
  found = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    for inner in ast.walk(node):
      names = []
      if isinstance(inner, ast.Import):
        names = [a.name for a in inner.names]
      elif isinstance(inner, ast.ImportFrom) and inner.module and not inner.level:
        names = [inner.module]
      found += [f"{path.relative_to(ROOT)}:{inner.lineno} {n}" for n in names
                if n.split(".")[0] in PACKAGES]
  return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_project_imports_inside_functions(package):
  files = sorted(pathlib.Path(ROOT, package).rglob("*.py"))
  assert [h for p in files for h in _hidden_imports(p)] == []


def test_the_contract_catches_a_cycle(tmp_path):
  # The check itself can fail: a copy of the package with one back-import breaks it.
  copy = tmp_path / "repo"
  for name in PACKAGES + ("setup.cfg",):
    src = pathlib.Path(ROOT, name)
    (shutil.copytree if src.is_dir() else shutil.copy)(src, copy / name)
  with open(copy / "semijax" / "core" / "offload.py", "a") as f:
    f.write("\nfrom semijax.core import tp  # noqa: E402\n")
  out = lint_imports(copy, dict(os.environ, PYTHONPATH=str(copy)))
  assert out.returncode != 0 and ".offload -> .tp" in out.stdout
