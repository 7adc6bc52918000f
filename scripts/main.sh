#!/usr/bin/env bash
# Set up a virtual environment and run the main job. Until the multi-peer simulation lands, the
# main job is the codec benchmark (every figure printed beside its reference and target).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]'
tessera bench codec "$@"
