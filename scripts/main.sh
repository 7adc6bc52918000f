#!/usr/bin/env bash
# Set up the environment and run the main job. Until the multi-peer simulation lands, the main
# job is the codec benchmark (every figure printed beside its reference and target).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
tessera bench codec "$@"
