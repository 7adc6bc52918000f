#!/usr/bin/env bash
# Set up the environment and run the main job: a whole run simulated on this machine (embedded
# chain and storage, 4 honest peers, one adversary of every kind, a validator). Extra arguments go
# to `tessera sim` (e.g. --windows 5, --storage 's3://tessera-demo?endpoint=http://127.0.0.1:9000').
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/setup.sh
tessera sim --peers 4 --windows 10 --adversaries noise,copier,stale,freeloader,nan,late \
  --out runs/demo --force "$@"
