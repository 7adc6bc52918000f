"""Cut every parameter tensor into chunks of at most C = tile*tile elements, without padding.

Every tensor is first seen as a 2-D matrix of ``rows x cols`` elements in row-major order, so
that flat position ``p`` of ``t.reshape(-1)`` is element ``(p // cols, p % cols)``:

* 1-D tensors of N elements: ``1 x N``;
* 2-D tensors ``(R, K)``: ``R x K``;
* tensors with more dimensions ``(d0, d1, ...)``: ``d0 x (d1 * d2 * ...)``, i.e. every leading
  index (an output channel of a convolution, an expert of a stacked MoE weight) is one row.

The matrix is then covered by at most four rectangular *groups* of equally shaped chunks. Each
group has one chunk size and therefore one number of kept entries ``k_g``; groups with no chunk
are left out, and their order is fixed:

=========  ===================================  ==========================================
group      2-D ``(R, K)``, tile T               1-D ``(N,)``, C = T*T
=========  ===================================  ==========================================
full       ``(R//T) x (K//T)`` tiles ``T x T``  ``N//C`` chunks of C consecutive elements
right      ``R//T`` tiles ``T x (K%T)``         one tail chunk of ``N%C`` elements
bottom     ``K//T`` tiles ``(R%T) x T``         --
corner     one tile ``(R%T) x (K%T)``           --
=========  ===================================  ==========================================

Within a group the chunks are numbered row-major over the grid of tiles (tile row first, then
tile column), and within a chunk the elements are numbered row-major over the tile: local
position ``p`` of a ``c x d`` tile is element ``(p // d, p % d)`` of that tile. A 1-D chunk is a
``1 x C`` tile, so its local position is simply the offset from its first element.

A group keeps ``k_g = clamp(round_half_up(k * C_g / C), 1, C_g)`` entries per chunk, so every
group has (about) the density ``k / C`` of a full chunk; except a 1-D tensor shorter than one
chunk (a norm's weights, a bias), which keeps ``min(k, N)``: such a vector is a few hundred
entries of a model of millions, and at ``k * N / C`` a 128-element norm would send 2 of them a
window, so it would barely train.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch

from codec.spec import CodecParams

__all__ = ["ChunkGroup", "ChunkLayout", "group_k"]


def group_k(k: int, chunk_size: int, full_chunk_size: int) -> int:
    """Entries kept in a chunk of ``chunk_size`` elements: ``k * chunk_size / C`` rounded half up."""
    kept = (2 * k * chunk_size + full_chunk_size) // (2 * full_chunk_size)
    return min(max(kept, 1), chunk_size)


@dataclass(frozen=True)
class ChunkGroup:
    """Equally shaped chunks covering one rectangle of a tensor's 2-D view.

    The rectangle starts at ``origin`` (row, column) and holds ``grid[0] x grid[1]`` tiles of
    ``tile[0] x tile[1]`` elements each; every tile is one chunk that keeps ``k`` entries.
    """

    chunk_size: int
    n_chunks: int
    k: int
    origin: tuple[int, int]
    grid: tuple[int, int]
    tile: tuple[int, int]

    @property
    def n_values(self) -> int:
        """Entries kept by the whole group."""
        return self.n_chunks * self.k


def _group(
    origin: tuple[int, int], grid: tuple[int, int], tile: tuple[int, int], params: CodecParams
) -> ChunkGroup:
    size = tile[0] * tile[1]
    return ChunkGroup(
        chunk_size=size,
        n_chunks=grid[0] * grid[1],
        k=group_k(params.k, size, params.chunk_size),
        origin=origin,
        grid=grid,
        tile=tile,
    )


def _groups_2d(rows: int, cols: int, params: CodecParams) -> tuple[ChunkGroup, ...]:
    t = params.tile
    nr, rr = divmod(rows, t)
    nc, rc = divmod(cols, t)
    rects = [
        ((0, 0), (nr, nc), (t, t)),
        ((0, nc * t), (nr, 1), (t, rc)),
        ((nr * t, 0), (1, nc), (rr, t)),
        ((nr * t, nc * t), (1, 1), (rr, rc)),
    ]
    return tuple(
        _group(o, g, s, params) for o, g, s in rects if g[0] * g[1] > 0 and s[0] * s[1] > 0
    )


def _groups_1d(n: int, params: CodecParams) -> tuple[ChunkGroup, ...]:
    c = params.chunk_size
    if n < c:  # a short vector keeps min(k, n) entries (see the module docstring)
        return (ChunkGroup(n, 1, min(params.k, n), (0, 0), (1, 1), (1, n)),)
    nf, tail = divmod(n, c)
    rects = [((0, 0), (1, nf), (1, c)), ((0, nf * c), (1, 1), (1, tail))]
    return tuple(_group(o, g, s, params) for o, g, s in rects if g[1] > 0 and s[1] > 0)


@dataclass(frozen=True)
class ChunkLayout:
    """How one tensor shape is cut into chunk groups (see the module docstring)."""

    shape: tuple[int, ...]
    rows: int
    cols: int
    groups: tuple[ChunkGroup, ...]

    @classmethod
    def for_shape(cls, shape: Sequence[int], params: CodecParams) -> ChunkLayout:
        """The layout of a tensor of ``shape`` under ``params`` (cached)."""
        return _layout(tuple(int(d) for d in shape), params.tile, params.k)

    @property
    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def n_chunks(self) -> int:
        return sum(g.n_chunks for g in self.groups)

    @property
    def n_values(self) -> int:
        """Entries kept per tensor, all groups together."""
        return sum(g.n_values for g in self.groups)

    def group_view(self, t: torch.Tensor, group_index: int) -> torch.Tensor:
        """A ``(grid_r, grid_c, tile_r, tile_c)`` view of ``t`` holding the group's chunks.

        Flattening the first two dimensions gives the chunk order, flattening the last two the
        in-chunk order. Writing into the view writes into ``t`` (which must be view-compatible
        with a ``rows x cols`` matrix, e.g. contiguous).
        """
        g = self.groups[group_index]
        (r0, c0), (a, b), (c, d) = g.origin, g.grid, g.tile
        mat = t.view(self.rows, self.cols)[r0 : r0 + a * c, c0 : c0 + b * d]
        return mat.unflatten(0, (a, c)).unflatten(2, (b, d)).permute(0, 2, 1, 3)

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The chunks of ``t``: one new ``(n_chunks, chunk_size)`` tensor per group."""
        self._check_tensor(t)
        t = t.contiguous()
        out = []
        for gi, g in enumerate(self.groups):
            chunks = torch.empty((g.n_chunks, g.chunk_size), dtype=t.dtype, device=t.device)
            chunks.view(*g.grid, *g.tile).copy_(self.group_view(t, gi))
            out.append(chunks)
        return out

    def merge(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """Inverse of `split`: a new tensor of the original shape."""
        if len(chunks) != len(self.groups):
            raise ValueError(f"expected {len(self.groups)} chunk groups, got {len(chunks)}")
        for g, c in zip(self.groups, chunks, strict=True):
            if tuple(c.shape) != (g.n_chunks, g.chunk_size):
                raise ValueError(
                    f"chunk group shape {tuple(c.shape)} != {(g.n_chunks, g.chunk_size)}"
                )
        out = torch.empty(self.shape, dtype=chunks[0].dtype, device=chunks[0].device)
        for gi, (g, c) in enumerate(zip(self.groups, chunks, strict=True)):
            self.group_view(out, gi).copy_(c.view(*g.grid, *g.tile))
        return out

    def chunk_offsets(self, group_index: int, device: torch.device | None = None) -> torch.Tensor:
        """Flat position in ``t.reshape(-1)`` of the first element of each chunk of a group."""
        g = self.groups[group_index]
        (r0, c0), (_, b), (c, d) = g.origin, g.grid, g.tile
        ch = torch.arange(g.n_chunks, dtype=torch.int64, device=device)
        return (r0 + (ch // b) * c) * self.cols + c0 + (ch % b) * d

    def flat_positions(self, group_index: int, idx: torch.Tensor) -> torch.Tensor:
        """Map local positions ``idx`` (n_chunks, k) of a group to flat positions in ``t.reshape(-1)``.

        Row ``i`` of ``idx`` holds positions inside chunk ``i`` of the group.
        """
        g = self.groups[group_index]
        if idx.dim() != 2 or idx.shape[0] != g.n_chunks:
            raise ValueError(f"idx must be ({g.n_chunks}, k), got {tuple(idx.shape)}")
        d = g.tile[1]
        idx = idx.to(torch.int64)
        local = (idx // d) * self.cols + idx % d
        return local + self.chunk_offsets(group_index, idx.device)[:, None]

    def _check_tensor(self, t: torch.Tensor) -> None:
        if tuple(t.shape) != self.shape:
            raise ValueError(f"tensor shape {tuple(t.shape)} != layout shape {self.shape}")


@lru_cache(maxsize=4096)
def _layout(shape: tuple[int, ...], tile: int, k: int) -> ChunkLayout:
    if not shape or any(d <= 0 for d in shape):
        raise ValueError(f"shape must have at least one dimension, all positive: {shape}")
    params = CodecParams(tile=tile, k=k)
    if len(shape) == 1:
        return ChunkLayout(shape, 1, shape[0], _groups_1d(shape[0], params))
    rows, cols = shape[0], math.prod(shape[1:])
    return ChunkLayout(shape, rows, cols, _groups_2d(rows, cols, params))
