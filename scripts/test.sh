#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, then the whole suite.
#
# The end-to-end tests (marked slow) keep real-time windows, so they run one after another in one
# pytest process while every other test runs beside them in a second one on one thread: the two
# cores are used without two end-to-end runs competing for them. Arguments, if any, go to a
# single pytest run instead (e.g. `bash scripts/test.sh -m subtensor`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ruff check .
ruff format --check .
if [ "$#" -gt 0 ]; then
  exec python -m pytest -q "$@"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pytest -q -m slow --basetemp "$tmp/e2e" >"$tmp/e2e.log" 2>&1 &
e2e=$!
status=0
OMP_NUM_THREADS=1 python -m pytest -q -m "not slow" --basetemp "$tmp/unit" || status=$?
wait "$e2e" || status=$?
echo "--- end-to-end tests (marked slow, run beside the others) ---"
cat "$tmp/e2e.log"
exit "$status"
