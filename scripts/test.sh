#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, type check, then the whole suite.
#
# With no arguments, four things share the two cores: at the lowest priority, the type check
# (mypy) and the unit tests (tests/unit, and the in-process tests of tests/e2e; two pytest-xdist
# workers), in the CPU time the others leave; at normal priority, the tests that time a deadline
# against the wall clock (tests/deadlines, on four workers: they mostly wait; niced, their
# loopback servers starve), and beside them, a little below (nice 5), the end-to-end tests
# (marked `slow`, in tests/e2e: real peers and validators on a ticking chain clock) on two
# workers: the deadline tests end within the simulations' start-up, which opens the first window
# only once every member is up, and from then on the end-to-end runs take what they need from the
# niced rest. Each prints its slowest tests. (A third end-to-end worker overloads two cores:
# simulated windows then run out for the nodes.)
# Arguments run one pytest with them (e.g. `bash scripts/test.sh -k consensus`).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
# one thread per test process and node: many processes share two cores, and torch's extra
# threads on these small models only spin (the simulation's DDP baseline: 44 CPU-s on two
# threads, 22 on one)
export OMP_NUM_THREADS=1
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
nice -n 19 mypy &
types=$!
nice -n 19 python -m pytest -q -p no:cacheprovider --durations=10 -n 2 \
    --dist worksteal -m "not slow" tests/unit tests/e2e &
rest=$!
python -m pytest -q -p no:cacheprovider -n 4 --dist worksteal tests/deadlines &
timed=$!
slow=0
nice -n 5 python -m pytest -q -p no:cacheprovider --durations=10 -n 2 --dist worksteal -m slow \
    tests/e2e || slow=$?
deadlines=0
wait "$timed" || deadlines=$?
unit=0
wait "$rest" || unit=$?
typed=0
wait "$types" || typed=$?
echo "type check: exit $typed; deadline tests: exit $deadlines; unit tests: exit $unit;" \
    "end-to-end tests: exit $slow"
[ "$typed" -eq 0 ] && [ "$deadlines" -eq 0 ] && [ "$unit" -eq 0 ] && [ "$slow" -eq 0 ]
