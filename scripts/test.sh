#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, type check, then the whole suite.
#
# With no arguments the suite runs as three processes on a 2-core machine: the end-to-end tests
# (marked `slow`, in tests/e2e: real peers and validators on a ticking chain clock, waiting on
# their clocks about half the time) in two lanes of about equal length at normal priority, and
# everything else at the lowest priority in the idle time they leave, so the e2e tests' clocks
# see the CPU they need. The unit tests that time their own loopback servers' answers (`TIMED`)
# run after the shorter lane, at normal priority: starved, they would miss their deadlines.
# Each prints its slowest tests.
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
TIMED=(tests/unit/test_fetch_crowd.py tests/unit/test_fetch_deadlines.py)
e2e() { python -m pytest -q -p no:cacheprovider --durations=5 -m slow tests/e2e "$@"; }
first_lane() {
    local rc=0
    e2e -k "$lane_a" || rc=$?
    python -m pytest -q -p no:cacheprovider -m "not slow" "${TIMED[@]}" || rc=$?
    return "$rc"
}
first_lane > >(sed -u 's/^/[e2e a] /') 2>&1 &
lane1=$!
e2e -k "not ($lane_a)" > >(sed -u 's/^/[e2e b] /') 2>&1 &
lane2=$!
ignored=()
for f in "${TIMED[@]}"; do ignored+=(--ignore "$f"); done
unit=0
OMP_NUM_THREADS=1 nice -n 19 python -m pytest -q -p no:cacheprovider --durations=10 -m "not slow" \
    "${ignored[@]}" tests || unit=$?
slow=0
wait "$lane1" || slow=$?
wait "$lane2" || slow=$?
echo "unit tests: exit $unit; end-to-end tests: exit $slow"
[ "$unit" -eq 0 ] && [ "$slow" -eq 0 ]
