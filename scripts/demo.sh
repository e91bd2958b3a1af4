#!/usr/bin/env bash
# The main job: the README demo on 8 fake CPU devices (sets up ./.venv on first use).
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
export XLA_FLAGS="${XLA_FLAGS:-} --xla_force_host_platform_device_count=8"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
exec "$PY" experiments/demo.py "$@"
