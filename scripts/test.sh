#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, type check, then the whole suite.
#
# With no arguments the suite runs as three processes on a 2-core machine: the end-to-end tests
# (marked `slow`, in tests/e2e: real peers and validators on a ticking chain clock, waiting on
# their clocks about half the time) in two lanes of about equal length, and everything else
# beside them. All three at the same priority: the unit tests' own loopback servers time their
# answers too, and a starved process misses those deadlines. Each prints its slowest tests.
# Arguments run one pytest with them (e.g. `bash scripts/test.sh -k consensus`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ruff check .
ruff format --check .
mypy
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
lane_a="ordinary_faults or s3_server or validator_weights or fsdp2"
e2e() { python -m pytest -q -p no:cacheprovider --durations=5 -m slow tests/e2e "$@"; }
e2e -k "$lane_a" > >(sed -u 's/^/[e2e a] /') 2>&1 &
lane1=$!
e2e -k "not ($lane_a)" > >(sed -u 's/^/[e2e b] /') 2>&1 &
lane2=$!
unit=0
OMP_NUM_THREADS=1 python -m pytest -q -p no:cacheprovider --durations=10 -m "not slow" tests || unit=$?
slow=0
wait "$lane1" || slow=$?
wait "$lane2" || slow=$?
echo "unit tests: exit $unit; end-to-end tests: exit $slow"
[ "$unit" -eq 0 ] && [ "$slow" -eq 0 ]
