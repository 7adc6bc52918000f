#!/usr/bin/env bash
# The checks only a CUDA machine can run, in one go: the codec's GPU path compiled for the device
# and compared bit for bit with the CPU path, then the GPU benchmarks. Results go to OUT_DIR
# (default runs/gpu-check): cuda_tests.txt and one JSON file per benchmark.
#
#   bash scripts/gpu-check.sh [OUT_DIR]
#
# Needs torch with CUDA and triton, and the project's own dependencies (on a machine without
# a package index, their wheels in WHEELS=folder); the tests run without the suite's conftest.
set -uo pipefail
out=${1:-runs/gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
# WHEELS: a folder of wheels installed first into a folder of their own, for a GPU machine with
# no package index (the project's dependencies its image lacks, downloaded for its Python)
if [ -n "${WHEELS:-}" ]; then
  site=$(mktemp -d)
  "$py" -m pip install -q --no-index --no-deps --target "$site" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
status=0
"$py" -m pytest -q -rs -p no:cacheprovider --noconftest tests/unit/test_cuda_codec.py 2>&1 \
  | tee "$out/cuda_tests.txt" || status=1
# GPU_BENCHES: the benches to run, separated by ';' (each a `tessera bench` command line)
# (the paper-regime training: twelve methods at once on the one GPU, about 26.5 M tokens each)
paper="train --preset lab/configs/paper-regime.toml --replicas 8 --windows 27 --tune"
paper+=" --strategies sparseloco:k=128 sparseloco:k=64 --jobs 12 --out $out/train"
IFS=';' read -ra benches <<< "${GPU_BENCHES:-codec;exchange --preset 1B --peers 8;$paper}"
for bench in "${benches[@]}"; do
  read -ra words <<< "$bench"
  name=${words[0]}
  echo "== tessera bench $bench --device cuda"
  # the bench layer alone (the CLI's other commands import the chain and store clients)
  "$py" -c 'import argparse, sys
from lab.bench import cli
parser = argparse.ArgumentParser(prog="tessera bench")
cli.add_arguments(parser)
sys.exit(cli.run(parser.parse_args(sys.argv[1:])))' "${words[@]}" --device cuda --json \
    > "$out/bench_$name.json" || status=1
  tail -c 3000 "$out/bench_$name.json"
done
exit $status
