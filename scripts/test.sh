#!/usr/bin/env bash
# Runs the test suite on 8 fake CPU devices (sets up ./.venv on first use).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$PY" -m pytest "$@"
