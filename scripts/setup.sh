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
# torch and any other pin come from scripts/constraints.txt, which the Docker image uses too.
# Where pip is pointed at a local copy of the CPU build (`find-links`), uv installs it from there
# (3 s instead of pip's 30: it links files from its cache and compiles a module's bytecode when
# it is first imported, not all of torch's at install); elsewhere pip, with its own index settings
links=${PIP_FIND_LINKS:-$(python -m pip config get global.find-links 2>/dev/null || true)}
from_links=()
for link in $links; do from_links+=(--find-links "$link"); done
if [ "${#from_links[@]}" -eq 0 ] ||
    ! uv pip install -q "${from_links[@]}" -c scripts/constraints.txt torch; then
    python -m pip install -q -c scripts/constraints.txt torch
fi
# the rest with uv (about seven times faster than pip), with pip where uv cannot reach the index
uv pip install -q -c scripts/constraints.txt -e '.[dev]' || {
    echo "uv could not install the project: pip installs it"
    python -m pip install -q -c scripts/constraints.txt -e '.[dev]'
}
# the codec's CPU loops compiled once and cached (about 15 s; a second or two once cached), so
# that the processes that start next (a simulation's nodes, the test workers) load them instead
# of each compiling them at once
python -m codec.native
