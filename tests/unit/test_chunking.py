"""Chunk layouts: groups partition the tensor, split/merge are exact inverses, positions map back."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from codec.chunking import ChunkLayout, group_k
from codec.spec import CodecParams


@st.composite
def layouts(draw: st.DrawFn) -> tuple[ChunkLayout, CodecParams]:
    tile = draw(st.integers(1, 9))
    k = draw(st.integers(1, tile * tile))
    ndim = draw(st.integers(1, 3))
    limit = {1: 400, 2: 40, 3: 12}[ndim]
    shape = tuple(draw(st.integers(1, limit)) for _ in range(ndim))
    params = CodecParams(tile=tile, k=k)
    return ChunkLayout.for_shape(shape, params), params


def _numbered(layout: ChunkLayout) -> torch.Tensor:
    return torch.arange(layout.numel, dtype=torch.float32).view(layout.shape)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1))
def test_split_merge_inverse(case: tuple[ChunkLayout, CodecParams], seed: int) -> None:
    layout, _ = case
    t = torch.randn(layout.shape, generator=torch.Generator().manual_seed(seed))
    chunks = layout.split(t)
    assert [tuple(c.shape) for c in chunks] == [(g.n_chunks, g.chunk_size) for g in layout.groups]
    assert torch.equal(layout.merge(chunks), t)


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_groups_partition_the_tensor(case: tuple[ChunkLayout, CodecParams]) -> None:
    layout, params = case
    assert 1 <= len(layout.groups) <= 4
    assert sum(g.n_chunks * g.chunk_size for g in layout.groups) == math.prod(layout.shape)
    for g in layout.groups:
        assert g.chunk_size <= params.chunk_size
        assert 1 <= g.k <= g.chunk_size
        short = len(layout.shape) == 1 and layout.numel < params.chunk_size
        want = (
            min(params.k, g.chunk_size)
            if short
            else group_k(params.k, g.chunk_size, params.chunk_size)
        )
        assert g.k == want
    # every element lands in exactly one chunk
    positions = torch.cat(
        [
            layout.flat_positions(gi, torch.arange(g.chunk_size).expand(g.n_chunks, -1)).reshape(-1)
            for gi, g in enumerate(layout.groups)
        ]
    )
    assert torch.equal(positions.sort().values, torch.arange(layout.numel))


@settings(max_examples=150, deadline=None)
@given(layouts(), st.integers(0, 2**31 - 1))
def test_flat_positions_match_split(case: tuple[ChunkLayout, CodecParams], seed: int) -> None:
    layout, _ = case
    gen = torch.Generator().manual_seed(seed)
    t = _numbered(layout)
    flat = t.reshape(-1)
    for gi, chunks in enumerate(layout.split(t)):
        g = layout.groups[gi]
        idx = torch.rand(g.n_chunks, g.chunk_size, generator=gen).argsort(1)[:, : g.k]
        assert torch.equal(flat[layout.flat_positions(gi, idx)], torch.gather(chunks, 1, idx))


def test_documented_order_2d() -> None:
    """Tiles row-major over the grid, elements row-major in a tile, groups full/right/bottom/corner."""
    params = CodecParams(tile=2, k=1)
    layout = ChunkLayout.for_shape((5, 3), params)
    t = _numbered(layout)  # element (r, c) holds 3r + c
    full, right, bottom, corner = layout.split(t)
    assert full.tolist() == [[0, 1, 3, 4], [6, 7, 9, 10]]
    assert right.tolist() == [[2, 5], [8, 11]]
    assert bottom.tolist() == [[12, 13]]
    assert corner.tolist() == [[14]]
    assert [g.tile for g in layout.groups] == [(2, 2), (2, 1), (1, 2), (1, 1)]


def test_documented_order_1d_and_nd() -> None:
    params = CodecParams(tile=2, k=2)
    one_d = ChunkLayout.for_shape((10,), params)
    full, tail = one_d.split(torch.arange(10.0))
    assert full.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tail.tolist() == [[8, 9]]
    assert [g.k for g in one_d.groups] == [2, 1]
    # (2, 2, 3) is seen as a 2 x 6 matrix
    nd = ChunkLayout.for_shape((2, 2, 3), params)
    assert (nd.rows, nd.cols) == (2, 6)
    assert nd.split(torch.arange(12.0).view(2, 2, 3))[0].tolist() == [
        [0, 1, 6, 7],
        [2, 3, 8, 9],
        [4, 5, 10, 11],
    ]


def test_default_params_llama_shapes() -> None:
    params = CodecParams()
    emb = ChunkLayout.for_shape((32000, 4096), params)
    assert [(g.chunk_size, g.n_chunks, g.k) for g in emb.groups] == [(4096, 500 * 64, 64)]
    norm = ChunkLayout.for_shape((4096,), params)
    assert [(g.chunk_size, g.n_chunks, g.k) for g in norm.groups] == [(4096, 1, 64)]
    ragged = ChunkLayout.for_shape((100, 200), params)
    assert [(g.chunk_size, g.n_chunks, g.k) for g in ragged.groups] == [
        (4096, 3, 64),
        (512, 1, 8),
        (2304, 3, 36),
        (288, 1, 5),
    ]
    assert ChunkLayout.for_shape((100, 200), params) is ragged  # cached


def test_group_view_writes_through() -> None:
    layout = ChunkLayout.for_shape((6, 7), CodecParams(tile=4, k=3))
    t = torch.zeros(6, 7)
    for gi in range(len(layout.groups)):
        layout.group_view(t, gi).fill_(gi + 1)
    assert sorted(t.unique().tolist()) == [1.0, 2.0, 3.0, 4.0]
    assert t[:4, :4].eq(1).all() and t[:4, 4:].eq(2).all()
    assert t[4:, :4].eq(3).all() and t[4:, 4:].eq(4).all()


def test_rejects_bad_input() -> None:
    params = CodecParams(tile=4, k=2)
    with pytest.raises(ValueError):
        ChunkLayout.for_shape((), params)
    with pytest.raises(ValueError):
        ChunkLayout.for_shape((3, 0), params)
    layout = ChunkLayout.for_shape((5, 5), params)
    with pytest.raises(ValueError):
        layout.split(torch.zeros(5, 6))
    with pytest.raises(ValueError):
        layout.merge(layout.split(torch.zeros(5, 5))[:-1])
    with pytest.raises(ValueError):
        layout.flat_positions(0, torch.zeros(2, 2, dtype=torch.int64))


def test_a_short_vector_keeps_min_k_n() -> None:
    """A 128-element norm keeps k entries (not k * 128 / 4096 = 2), a 40-element one all 40; a
    long vector's tail chunk keeps the proportional share."""
    params = CodecParams(tile=64, k=64)
    assert [g.k for g in ChunkLayout.for_shape((128,), params).groups] == [64]
    assert [g.k for g in ChunkLayout.for_shape((40,), params).groups] == [40]
    assert [g.k for g in ChunkLayout.for_shape((4096 + 128,), params).groups] == [64, 2]
