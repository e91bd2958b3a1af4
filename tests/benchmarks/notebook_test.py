"""colab/quickstart.ipynb: outputs are cleared, and its code cells run (so it cannot rot) from
colab/, where a local Jupyter starts, finding the project and filling the compilation cache."""

import os
import subprocess
import sys

import nbformat
import pytest

from helpers import ROOT

NOTEBOOK = os.path.join(ROOT, "colab", "quickstart.ipynb")


def test_outputs_are_cleared():
  nb = nbformat.read(NOTEBOOK, as_version=4)
  code = [c for c in nb.cells if c.cell_type == "code"]
  assert code and all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.mark.slow
def test_code_cells_run(tmp_path):
  nb = nbformat.read(NOTEBOOK, as_version=4)
  source = "\n\n".join(c.source for c in nb.cells if c.cell_type == "code")
  source += ("\n\nassert set(results) == {'even', 'proportional', 'semi'}"
             "\nassert payload['max_abs_loss_difference'] < 1e-4, payload"
             "\nassert results['semi']['balance']['compiles_after_warmup'] == 0"
             "\nassert png is None or os.path.getsize(png) > 0"
             "\nprint('NOTEBOOK OK')\n")
  (tmp_path / "quickstart.py").write_text(source)
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "JAX_COMPILATION_CACHE_DIR")}
  env.update(SEMIJAX_QUICKSTART_STEPS="3", XDG_CACHE_HOME=str(tmp_path / "cache"))
  out = subprocess.run([sys.executable, str(tmp_path / "quickstart.py")],
                       cwd=os.path.join(ROOT, "colab"), env=env, capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "NOTEBOOK OK" in out.stdout
  assert "| proportional | (" in out.stdout
  assert f"semijax at {ROOT} ;" in out.stdout
  assert os.listdir(tmp_path / "cache" / "semijax" / "jax")   # the compiled programs
