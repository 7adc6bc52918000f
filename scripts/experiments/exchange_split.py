"""Where one decode worker's time goes in `tessera bench exchange`: the same updates (the 1B
preset's first four decoder layers, 8 peers, encoded as the bench encodes them) decoded, then
summed into the clipped mean, each timed alone in this process on one thread, best of 7. The
digest is that of the mean's bytes in spec order (the bench's).

    python scripts/experiments/exchange_split.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from codec.pool import _compact, _sum_into
from codec.wire import decode_update
from lab.bench.exchange import digest, encode_updates
from node.model.shapes import layers_spec
from node.strategy import make_format
from protocol.runconfig import RunConfig


def best(fn: Callable[[], object], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        begun = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begun)
    return min(times)


def main() -> None:
    torch.set_num_threads(1)
    run = RunConfig.preset("1B")
    spec = layers_spec(run.model, 4)
    datas = encode_updates(run, spec, 8)
    cap = make_format(run, spec).max_update_bytes()

    def decoded() -> dict[int, list]:
        return {
            uid: [_compact(t, run.codec) for t in decode_update(data, spec, run.codec, cap).tensors]
            for uid, data in datas.items()
        }

    pieces = decoded()
    out = {t.name: torch.zeros(t.shape) for t in spec.tensors}

    def summed() -> None:
        _sum_into(out, pieces, sorted(pieces), run.codec, 1)

    summed()
    print(
        f"decode: {best(decoded):.3f} s; sum: {best(summed):.3f} s; mean {digest(out, spec)[:12]}"
    )


if __name__ == "__main__":
    main()
