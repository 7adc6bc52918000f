#!/usr/bin/env bash
# Set up the environment and run the tests: lint, format check, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
ruff check .
ruff format --check .
python -m pytest -q "$@"
