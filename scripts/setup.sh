#!/usr/bin/env bash
# Create .venv and install a CPU build of PyTorch, then the project with its dev extras.
# Sourced by scripts/main.sh and scripts/test.sh; leaves the venv activated.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# torch and any other pin come from scripts/constraints.txt, which the Docker image uses too
python -m pip install -q -c scripts/constraints.txt torch
python -m pip install -q -c scripts/constraints.txt -e '.[dev]'
