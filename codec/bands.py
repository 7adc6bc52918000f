"""Bands: the whole chunks of a tensor that hold a range of its rows, and an update cut to them.

A tensor sharded on its first dimension (FSDP2's ``Shard(0)``) gives each rank a range of rows
(of elements, for a 1-D tensor). Every rule of the window's mean is chunk-local (each chunk's
clip factor from the parts' norms in that chunk, each chunk divided by its own count) and every
entry is summed elementwise, so the mean of a *band* of whole chunks, computed from the updates
cut to that band, is bit for bit the whole mean's rows there. A rank can then build its rows of
the mean without any whole tensor.

A band of a 2-D view (`codec.chunking`) is a range of tile rows: it starts on a multiple of the
tile and ends on one or at the last row, so its own layout (`ChunkLayout.for_shape` of the
band's shape) is exactly the whole layout's chunks in it, in the same order. A band of a 1-D
tensor is a range of whole chunks; it never holds the tail chunk alone (a vector shorter than a
chunk keeps another number of entries per chunk than a tail does), and a vector of one chunk is
one band.
"""

from __future__ import annotations

from dataclasses import dataclass

from codec.chunking import ChunkLayout
from codec.compress import SparseGroup, SparseTensor
from codec.spec import CodecParams

__all__ = ["Band", "band_of", "cut"]


@dataclass(frozen=True)
class Band:
    """Rows ``[start, stop)`` of a tensor's first dimension (elements of a 1-D tensor), made of
    whole chunks, and for each chunk group of the whole layout the chunks ``[first, last)`` in
    the band (empty where the group has none there)."""

    start: int
    stop: int
    chunks: tuple[tuple[int, int], ...]

    def shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The band's own shape, for a tensor of ``shape``."""
        return (self.stop - self.start, *shape[1:])


def band_of(shape: tuple[int, ...], params: CodecParams, lo: int, hi: int) -> Band:
    """The smallest band of a tensor of ``shape`` that holds its rows ``[lo, hi)``."""
    layout = ChunkLayout.for_shape(shape, params)
    if not 0 <= lo < hi <= shape[0]:
        raise ValueError(f"rows [{lo}, {hi}) of a tensor of {shape[0]}")
    if len(shape) == 1:
        return _band_1d(layout, params.chunk_size, lo, hi)
    return _band_2d(layout, params.tile, lo, hi)


def _band_2d(layout: ChunkLayout, tile: int, lo: int, hi: int) -> Band:
    rows = layout.rows
    start, stop = lo // tile * tile, min(-(-hi // tile) * tile, rows)
    full_rows = rows // tile * tile  # the rows the full and right groups cover
    chunks = []
    for g in layout.groups:
        r0 = g.origin[0]
        if r0 >= full_rows:  # the bottom and corner groups: the last, partial tile row
            chunks.append((0, g.n_chunks) if stop > full_rows else (0, 0))
            continue
        per_row = g.grid[1]  # chunks in one tile row of the group
        first, last = start // tile, min(stop, full_rows) // tile
        chunks.append((first * per_row, max(first, last) * per_row))
    return Band(start, stop, tuple(chunks))


def _band_1d(layout: ChunkLayout, chunk: int, lo: int, hi: int) -> Band:
    n = layout.cols
    if n <= chunk:
        return Band(0, n, tuple((0, g.n_chunks) for g in layout.groups))
    whole = n // chunk * chunk
    start, stop = lo // chunk * chunk, min(-(-hi // chunk) * chunk, n)
    start = min(start, whole - chunk)  # never the tail chunk alone
    chunks = []
    for g in layout.groups:
        if g.origin[1] >= whole:  # the tail chunk
            chunks.append((0, 1) if stop > whole else (0, 0))
        else:
            chunks.append((start // chunk, min(stop, whole) // chunk))
    return Band(start, stop, tuple(chunks))


def cut(piece: SparseTensor, band: Band, params: CodecParams) -> SparseTensor:
    """``piece`` cut to ``band``: the chunks in it, their entries as they are (positions are
    local to a chunk), the whole codebook; a sparse tensor of the band's shape."""
    shape = band.shape(piece.shape)
    groups = [
        SparseGroup(g.idx[a:b], g.codes[a:b], g.scales[a:b])
        for g, (a, b) in zip(piece.groups, band.chunks, strict=True)
        if b > a
    ]
    own = ChunkLayout.for_shape(shape, params).groups
    if [g.idx.shape[0] for g in groups] != [g.n_chunks for g in own]:
        raise AssertionError(f"{piece.name}: band {band} is not whole chunks of {piece.shape}")
    return SparseTensor(piece.name, shape, groups, piece.codebook)
