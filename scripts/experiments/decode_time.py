"""The time to decode a few updates of a preset's real shapes with `codec.wire.decode_update`, in
one process on one thread (best of ``--repeats``, wall time): the decode alone, without the pool
and the sum of `tessera bench exchange`, for comparing two versions of the decoder on one host.
Run it from each version's checkout, one after the other, a few times each (docs/results.md,
"Exchange").

    python scripts/experiments/decode_time.py --preset 1B --layers 4 --updates 2 --repeats 12
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from codec import wire  # noqa: E402
from lab.bench.exchange import encode_updates  # noqa: E402
from node.model.shapes import layers_spec  # noqa: E402
from node.strategy import make_format  # noqa: E402
from protocol.runconfig import RunConfig  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1B")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (0: all)")
    parser.add_argument("--updates", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    run = RunConfig.preset(args.preset)
    spec = layers_spec(run.model, args.layers)
    datas = encode_updates(run, spec, args.updates)
    cap = make_format(run, spec).max_update_bytes()
    best = float("inf")
    for _ in range(args.repeats):
        begun = time.perf_counter()
        for data in datas.values():
            wire.decode_update(data, spec, run.codec, cap)
        best = min(best, time.perf_counter() - begun)
    print(f"{args.updates} updates of {args.preset} ({args.layers} layers): best {best:.4f} s")


if __name__ == "__main__":
    main()
