#!/usr/bin/env bash
# Set up a virtual environment (CPU torch first, then the project with its dev extras) and run the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]'
ruff check .
ruff format --check .
python -m pytest -q "$@"
