#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ruff check .
ruff format --check .
# Two workers: the end-to-end tests (marked slow) run one after another on one of them, since
# their windows keep real time; everything else runs on the other (tests/conftest.py).
python -m pytest -q -n 2 --dist loadgroup "$@"
