#!/usr/bin/env bash
# Runs the test suite on 8 fake CPU devices (sets up ./.venv on first use).
#
# XLA:CPU, with 8 devices in one process, now and then aborts the process in a collective's
# rendezvous ("Termination timeout for `collective permute ...`": some of a program's device
# threads never arrive; seen in about 1 of 7 CI runs, always in tests/core/migrate_test.py, and
# not pinned down: README, "Tests"). Such an abort, and no other failure, reruns the suite once.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
set +e
"$PY" -m pytest "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && grep -q "Termination timeout for .collective" "$log"; then
  echo "test.sh: XLA:CPU aborted in a collective's rendezvous (exit $rc); rerunning once" >&2
  "$PY" -m pytest "$@"
  rc=$?
fi
exit "$rc"
