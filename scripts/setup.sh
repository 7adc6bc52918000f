#!/usr/bin/env bash
# Create .venv and install a CPU build of PyTorch, then the project with its dev extras.
# Sourced by scripts/main.sh and scripts/test.sh; leaves the venv activated.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]'
