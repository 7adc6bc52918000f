#!/usr/bin/env bash
# Create .venv and install a CPU build of PyTorch, then the project with its dev extras.
# Sourced by scripts/main.sh and scripts/test.sh; leaves the venv activated.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
python3 -m venv .venv
# every command starts Python processes (a simulation a dozen, the tests hundreds): each would
# compile every module it imports again where the environment forbids writing bytecode (uv
# installs without it), about a second of CPU per process
unset PYTHONDONTWRITEBYTECODE
. .venv/bin/activate
python -m pip install -q --upgrade pip uv
# torch and any other pin come from scripts/constraints.txt, which the Docker image uses too;
# torch with pip, which finds a local copy of the CPU build where the machine has one
python -m pip install -q -c scripts/constraints.txt torch
# the rest with uv (about seven times faster than pip), with pip where uv cannot reach the index
uv pip install -q -c scripts/constraints.txt -e '.[dev]' || {
    echo "uv could not install the project: pip installs it"
    python -m pip install -q -c scripts/constraints.txt -e '.[dev]'
}
