# Sourced by the other scripts: makes ./.venv with semijax (editable) and its extras, once.
# Needs only python3 (>= 3.11) and network access to PyPI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="$VENV/bin/python"
if [[ ! -f "$VENV/.semijax-installed" || "$ROOT/setup.cfg" -nt "$VENV/.semijax-installed" ]]; then
  echo "setting up $VENV (first run only) ..." >&2
  python3 -m venv "$VENV"
  "$PY" -m pip install --quiet --disable-pip-version-check -e "$ROOT[test]"
  touch "$VENV/.semijax-installed"
fi
cd "$ROOT"
