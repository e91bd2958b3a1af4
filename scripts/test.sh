#!/usr/bin/env bash
# Runs the test suite on 8 fake CPU devices (sets up ./.venv on first use).
#
# XLA:CPU, with 8 devices in one process, aborted the test process now and then in a
# collective's rendezvous ("Termination timeout for `all reduce ...`" or "`collective permute`":
# some device threads of a program never arrived), while a move copied its input leaf by leaf.
# The copies are now one program (`migrate._copy_leaves`); should the abort recur, it, and no
# other failure, reruns the failed tests once (pytest's --last-failed).
#
# The tests run in one worker process per core, at most 4 (pytest-xdist; a file's tests stay in
# one worker, which shares their fixtures and compiled programs): most of a test's time is
# tracing and compiling, on one core. Pass -n 0 to run them in this process.
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
workers=(-n auto --maxprocesses=4 --dist=loadfile)
set +e
"$PY" -m pytest "${workers[@]}" "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
if [ "$rc" -ne 0 ] && grep -q "rendezvous.*Termination timeout for" "$log"; then
  echo "test.sh: XLA:CPU aborted in a collective's rendezvous (exit $rc); rerunning the failed" \
    "tests once" >&2
  "$PY" -m pytest "${workers[@]}" --last-failed "$@"
  rc=$?
fi
exit "$rc"
