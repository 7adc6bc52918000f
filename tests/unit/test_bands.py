"""A band's mean is the whole mean's rows there, bit for bit (`codec.bands`): every rank of a
sharded peer can build its own rows of the window's mean from the updates cut to its band.

Real updates through the real compressor, of shapes with partial tiles and a vector with a tail
chunk; norms far apart so that clipping scales some chunks; shards of 2 to 5 ranks as FSDP2 cuts
the first dimension; SparseLoCo and DeMo (which sums DCT coefficients and inverts them at the
end), with and without ``outer.min_support``.
"""

from __future__ import annotations

import pytest
import torch

from codec.bands import band_of, cut
from codec.compress import Compressor, SparseTensor
from codec.spec import ModelSpec, TensorSpec
from node.strategy import make_strategy
from protocol.runconfig import RunConfig

SHAPES = {"w": (200, 72), "v": (10_000,), "short": (96,), "thin": (40, 300)}
SPEC = ModelSpec(tensors=tuple(TensorSpec(name=n, shape=s) for n, s in SHAPES.items()))


def _run(strategy: str, support: int) -> RunConfig:
    return RunConfig.preset(
        "tiny",
        strategy=strategy,
        codec={"tile": 32, "k": 16},
        outer={"min_support": support},
    )


def _updates(run: RunConfig, peers: int) -> dict[int, list[SparseTensor]]:
    gen = torch.Generator().manual_seed(peers)
    out = {}
    for uid in range(peers):
        compressor = Compressor(SPEC, run.codec)
        scale = 10.0 ** (uid - 2)  # norms far apart: the median clips the large ones
        out[uid] = [
            compressor.compress(t.name, torch.randn(t.shape, generator=gen) * scale, 0.9)
            for t in SPEC.tensors
        ]
    return out


def _shard_rows(rows: int, world: int) -> list[tuple[int, int]]:
    """Dim-0 shards as FSDP2 cuts them (torch.chunk): ceil(rows / world) each, the last short."""
    size = -(-rows // world)
    return [(min(r * size, rows), min((r + 1) * size, rows)) for r in range(world)]


@pytest.mark.parametrize(
    ("strategy", "support"), [("sparseloco", 1), ("sparseloco", 2), ("demo", 1)]
)
def test_each_shards_band_mean_is_the_whole_means_rows(strategy: str, support: int) -> None:
    run = _run(strategy, support)
    updates = _updates(run, 5)
    whole = make_strategy(run, SPEC).aggregator.mean(updates)
    for world in (2, 3, 4, 5):
        for name, shape in SHAPES.items():
            for lo, hi in _shard_rows(shape[0], world):
                if lo == hi:
                    continue
                band = band_of(shape, run.codec, lo, hi)
                assert band.start <= lo < hi <= band.stop
                spec = ModelSpec(tensors=(TensorSpec(name=name, shape=band.shape(shape)),))
                pieces = {
                    u: [cut(p, band, run.codec) for p in pieces if p.name == name]
                    for u, pieces in updates.items()
                }
                mean = make_strategy(run, spec).aggregator.mean(pieces)[name]
                got = mean[lo - band.start : hi - band.start]
                want = whole[name][lo:hi]
                assert torch.equal(got, want), (strategy, world, name, lo, hi)


def test_a_band_is_whole_chunks_and_never_the_whole_of_a_large_tensor() -> None:
    run = _run("sparseloco", 1)
    for world in (2, 4):
        for lo, hi in _shard_rows(200, world):  # 200 rows: six tiles of 32 and a partial one
            band = band_of((200, 72), run.codec, lo, hi)
            assert band.start % 32 == 0 and (band.stop % 32 == 0 or band.stop == 200)
            assert band.stop - band.start < 200
    # a vector's band never holds its tail chunk alone (another k per chunk than a short vector)
    tail = band_of((10_000,), run.codec, 9_990, 10_000)
    assert tail.stop == 10_000 and tail.stop - tail.start > 10_000 % 1024
    assert band_of((96,), run.codec, 48, 96).start == 0  # one chunk: the band is the vector
    with pytest.raises(ValueError, match="rows"):
        band_of((96,), run.codec, 50, 40)
