#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, type check, then the whole suite.
#
# With no arguments the suite runs as two pytest sessions of two workers each (pytest-xdist): the
# end-to-end tests (marked `slow`, in tests/e2e: real peers and validators on a ticking chain
# clock, which leave most of a core idle while they wait for blocks) at normal priority, started
# first, with the type check beside their start-up; then everything else at the lowest priority
# in the CPU time the e2e tests leave. Each prints its slowest tests. (A third end-to-end worker
# overloads two cores: simulated windows then run out for the nodes.)
# Arguments run one pytest with them (e.g. `bash scripts/test.sh -k consensus`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# the report page's test opens it in a real browser (Debian's chromium) and the live view's test
# runs a real Prometheus (Debian's prometheus), where this machine can install them (as root,
# with apt); elsewhere those tests skip and say why
apt_install() {  # PACKAGE [APT FLAGS]: when its command is missing, as root, with apt
    if command -v "$1" >/dev/null || [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        return 0
    fi
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"; } \
        >/dev/null 2>&1 || echo "$1 could not be installed: the tests that need it skip"
}
apt_install chromium
apt_install prometheus --no-install-recommends
ruff check .
ruff format --check .
if [ "$#" -gt 0 ]; then
    mypy
    exec python -m pytest -q "$@"
fi
python -m pytest -q -p no:cacheprovider --durations=10 -n 2 --dist worksteal -m slow tests/e2e &
e2e=$!
# the type check while the end-to-end tests start their nodes, before the other tests (beside
# those it would load the machine while the fetch deadline tests run)
mypy || { kill "$e2e"; wait "$e2e" || true; exit 1; }
unit=0
OMP_NUM_THREADS=1 nice -n 19 python -m pytest -q -p no:cacheprovider --durations=10 -n 2 --dist worksteal \
    -m "not slow" tests || unit=$?
slow=0
wait "$e2e" || slow=$?
echo "unit tests: exit $unit; end-to-end tests: exit $slow"
[ "$unit" -eq 0 ] && [ "$slow" -eq 0 ]
