#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, then the whole suite.
#
# With no arguments the suite runs as two processes, so it fits CI's 15 minutes on 2 cores: the
# end-to-end tests (marked `slow`: real peers and validators on a ticking chain clock) at normal
# priority, and everything else at the lowest priority in the idle time the e2e tests leave, so
# the e2e tests' clocks see the CPU they would have alone. Arguments run one pytest with them
# (e.g. `bash scripts/test.sh -m subtensor`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ruff check .
ruff format --check .
if [ "$#" -gt 0 ]; then
    exec python -m pytest -q "$@"
fi
python -m pytest -q -p no:cacheprovider -m slow &
e2e=$!
unit=0
nice -n 19 python -m pytest -q -p no:cacheprovider -m "not slow" || unit=$?
slow=0
wait "$e2e" || slow=$?
echo "unit tests: exit $unit; end-to-end tests: exit $slow"
[ "$unit" -eq 0 ] && [ "$slow" -eq 0 ]
