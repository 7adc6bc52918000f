"""``python -m codec.native``: compile the codec's CPU loops and cache them on disk.

A process that finds them cached loads them in a fraction of a second; one that does not compiles
them (about 10 CPU-seconds). Run once after installing, before many processes start at once (a
simulation's nodes, the test suite's workers), so that they load the loops instead of each
compiling them."""

from __future__ import annotations

import torch

from codec import wire
from codec.aggregate import aggregate
from codec.compress import Compressor, SparseTensor, densify
from codec.spec import CodecParams, ModelSpec, TensorSpec


def main() -> None:
    """Encode, decode and sum two small updates: every compiled loop runs once."""
    params = CodecParams(tile=8, k=4)
    spec = ModelSpec(
        tensors=(TensorSpec(name="w", shape=(20, 12)), TensorSpec(name="b", shape=(100,)))
    )
    gen = torch.Generator().manual_seed(0)
    updates: dict[int, list[SparseTensor]] = {}
    for uid in (0, 1):
        compressor = Compressor(spec, params)
        pieces = [
            compressor.compress(t.name, torch.randn(t.shape, generator=gen), 0.9)
            for t in spec.tensors
        ]
        decoded = wire.decode_update(wire.encode_update(pieces, params, spec), spec, params)
        updates[uid] = [p for p in decoded.tensors if isinstance(p, SparseTensor)]
    aggregate(updates, spec, params, clip_to_median=True)
    densify(updates[0][0], params)


if __name__ == "__main__":
    main()
