"""Aggregation: the mean of decoded updates, independent of arrival order, with median clipping."""

from __future__ import annotations

import math
import random

import pytest
import torch

from codec.aggregate import (
    aggregate,
    chunk_clip,
    chunk_norms,
    clip_factors,
    divide_chunks,
    sum_clipped,
    update_norm,
)
from codec.chunking import ChunkLayout
from codec.compress import Compressor, SparseTensor, densify, scatter_add
from codec.errors import DecodeError
from codec.spec import CodecParams, ModelSpec
from tests.support.clip_reference import chunk_clipped_mean

SHAPES = {"w": (48, 80), "b": (200,), "x": (3, 5, 9)}
SPEC = ModelSpec.from_shapes(SHAPES)
PARAMS = CodecParams(tile=16, k=12, max_abs_value=1e6)  # the outlier peer sends values of ~40


def _update(seed: int, scale: float = 1.0) -> list[SparseTensor]:
    gen = torch.Generator().manual_seed(seed)
    comp = Compressor(SPEC, PARAMS)
    return [
        comp.compress(name, torch.randn(shape, generator=gen) * scale, 0.95)
        for name, shape in SHAPES.items()
    ]


@pytest.fixture(scope="module")
def peers() -> dict[str, list[SparseTensor]]:
    scales = [1.0, 0.5, 3.0, 1.5, 40.0]
    return {f"peer-{i}": _update(i, s) for i, s in enumerate(scales)}


def _dense(update: list[SparseTensor]) -> dict[str, torch.Tensor]:
    return {s.name: densify(s, PARAMS) for s in update}


@pytest.mark.parametrize("clip", [False, True])
def test_order_independent_bitwise(peers: dict[str, list[SparseTensor]], clip: bool) -> None:
    first = aggregate(peers, SPEC, PARAMS, clip_to_median=clip)
    keys = list(peers)
    rng = random.Random(0)
    for _ in range(4):
        rng.shuffle(keys)
        shuffled = {k: list(reversed(peers[k])) for k in keys}
        again = aggregate(shuffled, SPEC, PARAMS, clip_to_median=clip)
        assert all(torch.equal(first[n], again[n]) for n in SHAPES)


def test_mean_matches_dense_reference(peers: dict[str, list[SparseTensor]]) -> None:
    mean = aggregate(peers, SPEC, PARAMS)
    dense = [_dense(u) for u in peers.values()]
    for name in SHAPES:
        ref = torch.stack([d[name].double() for d in dense]).mean(0)
        torch.testing.assert_close(mean[name].double(), ref, rtol=1e-6, atol=1e-6)
        assert mean[name].dtype == torch.float32 and tuple(mean[name].shape) == SHAPES[name]


def test_update_norm_matches_dense(peers: dict[str, list[SparseTensor]]) -> None:
    for update in peers.values():
        dense = torch.cat([t.double().reshape(-1) for t in _dense(update).values()])
        assert math.isclose(update_norm(update), float(dense.norm()), rel_tol=1e-12)


def test_clip_factors() -> None:
    assert clip_factors([1.0, 2.0, 4.0]) == [1.0, 1.0, 0.5]
    assert clip_factors([1.0, 3.0, 5.0, 8.0]) == [1.0, 1.0, 0.6, 0.375]  # the lower median, 3
    assert clip_factors([0.0, 0.0, 2.0]) == [1.0, 1.0, 0.0]
    assert clip_factors([]) == []


def test_median_clipping_chunk_by_chunk(peers: dict[str, list[SparseTensor]]) -> None:
    """Each chunk of each update scaled to at most the lower median of that chunk's norms over
    the updates, and the chunk's sum divided by the count in which each counts
    min(norm, median) / median: computed here from the dense updates, chunk by chunk."""
    clipped = aggregate(peers, SPEC, PARAMS, clip_to_median=True)
    dense = [_dense(u) for u in peers.values()]
    for name, shape in SHAPES.items():
        ref = chunk_clipped_mean([d[name] for d in dense], ChunkLayout.for_shape(shape, PARAMS))
        torch.testing.assert_close(clipped[name].double(), ref, rtol=1e-5, atol=1e-6)
    # the outlier peer (scale 40) dominates the plain mean but no chunk of the clipped one
    plain = aggregate(peers, SPEC, PARAMS)
    assert float(plain["w"].abs().max()) > 5 * float(clipped["w"].abs().max())


def test_missing_unknown_and_empty(peers: dict[str, list[SparseTensor]]) -> None:
    partial = {"a": [s for s in peers["peer-0"] if s.name != "b"], "b": peers["peer-1"]}
    mean = aggregate(partial, SPEC, PARAMS)
    torch.testing.assert_close(mean["b"], densify(peers["peer-1"][1], PARAMS) / 2)
    empty = aggregate({}, SPEC, PARAMS)
    assert all(not t.any() for t in empty.values())
    stray = SparseTensor("zzz", (4,), peers["peer-0"][1].groups, peers["peer-0"][1].codebook)
    with pytest.raises(DecodeError):
        aggregate({"a": [*peers["peer-0"], stray]}, SPEC, PARAMS)
    with pytest.raises(DecodeError):
        aggregate({"a": [*peers["peer-0"], peers["peer-0"][0]]}, SPEC, PARAMS)
    broken = peers["peer-0"][0]
    bad = SparseTensor(broken.name, broken.shape, broken.groups, broken.codebook * -1)
    with pytest.raises(DecodeError):
        aggregate({"a": [bad]}, SPEC, PARAMS)


def test_the_clipped_mean_in_cache_is_the_steps_one_after_another_bit_for_bit() -> None:
    """`sum_clipped` on the CPU zeroes, sums and divides a band of chunks at a time; it must give
    exactly what zeroing, one scatter per update in key order and the chunk division give, on
    edge tiles, 1-D and 3-D tensors, an update without a tensor and a tensor nobody sends,
    whatever the buffer held."""
    shapes = {"w": (50, 83), "v": (16, 48), "b": (203,), "x": (3, 5, 9), "none": (7, 9)}
    spec = ModelSpec.from_shapes(shapes)
    comp = Compressor(spec, PARAMS)
    gen = torch.Generator().manual_seed(5)
    updates = []
    for i, scale in enumerate([1.0, 0.25, 6.0, 1.5, 1e-3]):
        names = [n for n in shapes if n != "none" and not (i == 1 and n == "w")]
        updates.append(
            {n: comp.compress(n, torch.randn(shapes[n], generator=gen) * scale, 0.9) for n in names}
        )
    for name, shape in shapes.items():
        pieces = [u.get(name) for u in updates]
        layout = ChunkLayout.for_shape(shape, PARAMS)
        clip = chunk_clip(
            [None if p is None else chunk_norms(p) for p in pieces],
            [g.n_chunks for g in layout.groups],
        )
        steps = torch.zeros(shape)
        for piece, factors in zip(pieces, clip.factors, strict=True):
            if piece is not None and factors is not None:
                scatter_add(steps, piece, PARAMS, factors, triton=False)
        divide_chunks(steps, layout, clip.divisors)
        fused = torch.full(shape, float("nan"))
        sum_clipped(fused, pieces, PARAMS)
        assert torch.equal(fused.view(torch.int32), steps.view(torch.int32)), name
        assert name != "none" or not fused.any()
