"""Dequantise and scatter-add one chunk group into a dense float32 tensor, compiled for the CPU:
what `codec.compress.scatter_add` does with torch ops (flat positions, levels, signs, one
`index_add_`), done in one pass over the group's entries.

Each entry adds ``v * factor[chunk]`` to its element with ``v = ±(codebook[row, high] * scale)``: the
same float32 product, sign and float32 sum as the torch path, so the result is the same bit for
bit (no fused multiply-add: the multiply and the add round separately, as `index_add_` does).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from codec.chunking import ChunkLayout
from codec.quantize import SCALE_LUT

__all__ = ["mean_group", "scatter_group"]

_LUT = SCALE_LUT.numpy().astype(np.float32)


def scatter_group(
    out: torch.Tensor,
    layout: ChunkLayout,
    group_index: int,
    idx: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    codebook: torch.Tensor,
    factor: torch.Tensor,
) -> None:
    """Add ``factor[chunk] * dequantize(codes, scales, codebook)`` at the chunk-local positions
    ``idx`` (n_chunks, k) of group ``group_index`` into ``out`` (contiguous float32, on the CPU);
    ``factor`` is float32 (n_chunks,)."""
    g = layout.groups[group_index]
    (r0, c0), (_, per_row), (tile_rows, tile_cols) = g.origin, g.grid, g.tile
    _scatter(
        out.view(-1).numpy(), idx.numpy(), codes.numpy(), scales.numpy(),
        codebook.numpy(), _LUT, factor.to(torch.float32).contiguous().numpy(),
        r0, c0, per_row, tile_rows, tile_cols, layout.cols,
    )  # fmt: skip


@numba.njit(cache=True, nogil=True)
def _scatter(
    out: np.ndarray, idx: np.ndarray, codes: np.ndarray, scales: np.ndarray, codebook: np.ndarray, lut: np.ndarray, factor: np.ndarray,
    r0: int, c0: int, per_row: int, tile_rows: int, tile_cols: int, cols: int,
) -> None:  # fmt: skip
    n, k = idx.shape
    shift = -1  # tile_cols a power of two: positions split with a shift and a mask
    if tile_cols & (tile_cols - 1) == 0:
        shift = 0
        while 1 << shift < tile_cols:
            shift += 1
    for ch in range(n):
        side = scales[ch]
        scale = lut[side >> 2]
        row = side & 3
        low = codebook[row, 0] * scale
        high = codebook[row, 1] * scale
        f = factor[ch]
        first = (r0 + (ch // per_row) * tile_rows) * cols + c0 + (ch % per_row) * tile_cols
        for j in range(k):
            p = np.int64(idx[ch, j])
            if shift >= 0:
                at = first + (p >> shift) * cols + (p & (tile_cols - 1))
            else:
                at = first + (p // tile_cols) * cols + p % tile_cols
            c = codes[ch, j]
            mag = high if c >> 1 else low
            out[at] += (-mag if c & 1 else mag) * f


def mean_group(
    out: torch.Tensor,
    layout: ChunkLayout,
    group_index: int,
    pieces: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]],
    factors: list[torch.Tensor],
    divisors: torch.Tensor,
) -> None:
    """Overwrite the chunks of group ``group_index`` of ``out`` (contiguous float32, on the
    CPU) with the window's clipped mean there: per chunk, zeros, then each update's entries
    (``pieces``: idx, codes, scales, codebook per update, in the order they are summed) times
    its factor added in turn, then the chunk divided by its divisor (left as it is where that is
    0). The same float32 operations per element as zeroing, `scatter_group` per update in that
    order and `codec.aggregate.divide_chunks`, so the same result bit for bit, in one pass over
    the memory instead of one per update and two more."""
    g = layout.groups[group_index]
    (r0, c0), (_, per_row), (tile_rows, tile_cols) = g.origin, g.grid, g.tile
    if pieces:
        dtype = pieces[0][0].dtype
        idx = torch.stack([p[0].to(dtype) for p in pieces]).numpy()
        codes = torch.stack([p[1] for p in pieces]).numpy()
        scales = torch.stack([p[2] for p in pieces]).numpy()
        codebooks = np.zeros((len(pieces), 4, 2), np.float32)  # at most 4 rows (2 bits)
        for u, p in enumerate(pieces):
            codebooks[u, : p[3].shape[0]] = p[3].numpy()
        factor = torch.stack([f.to(torch.float32) for f in factors]).numpy()
    else:
        idx = np.zeros((0, g.n_chunks, g.k), np.int16)
        codes = np.zeros((0, g.n_chunks, g.k), np.uint8)
        scales = np.zeros((0, g.n_chunks), np.uint8)
        codebooks = np.zeros((0, 4, 2), np.float32)
        factor = np.zeros((0, g.n_chunks), np.float32)
    _mean(
        out.view(-1).numpy(), idx, codes, scales, codebooks, _LUT, factor,
        divisors.to(torch.float32).contiguous().numpy(),
        r0, c0, per_row, tile_rows, tile_cols, layout.cols,
    )  # fmt: skip


@numba.njit(cache=True, nogil=True)
def _mean(
    out: np.ndarray, idx: np.ndarray, codes: np.ndarray, scales: np.ndarray, codebooks: np.ndarray, lut: np.ndarray,
    factors: np.ndarray, divisors: np.ndarray, r0: int, c0: int, per_row: int, tile_rows: int, tile_cols: int, cols: int,
) -> None:  # fmt: skip
    """A band of tiles (one row of the grid: contiguous rows of the tensor) at a time: zeroed,
    every update's entries added (updates in order), each tile divided. Offsets are unsigned,
    so the loops over contiguous elements compile to vector instructions."""
    updates, n, k = idx.shape
    if n == 0:
        return
    shift = -1  # tile_cols a power of two: positions split with a shift and a mask
    if tile_cols & (tile_cols - 1) == 0:
        shift = 0
        while 1 << shift < tile_cols:
            shift += 1
    width = np.uint64(per_row * tile_cols)
    stride, tc = np.uint64(cols), np.uint64(tile_cols)
    for band in range(n // per_row):
        start = np.uint64((r0 + band * tile_rows) * cols + c0)
        for r in range(tile_rows):
            at = start + np.uint64(r) * stride
            for c in range(width):
                out[at + np.uint64(c)] = 0.0
        for u in range(updates):
            for j in range(per_row):
                ch = band * per_row + j
                side = scales[u, ch]
                scale = lut[side >> 2]
                row = side & 3
                low = codebooks[u, row, 0] * scale
                high = codebooks[u, row, 1] * scale
                f = factors[u, ch]
                first = start + np.uint64(j) * tc
                for e in range(k):
                    p = np.uint64(idx[u, ch, e])
                    if shift >= 0:
                        at = first + (p >> np.uint64(shift)) * stride + (p & (tc - np.uint64(1)))
                    else:
                        at = first + (p // tc) * stride + p % tc
                    c = codes[u, ch, e]
                    mag = high if c >> 1 else low
                    out[at] += (-mag if c & 1 else mag) * f
        for r in range(tile_rows):
            at = start + np.uint64(r) * stride
            for j in range(per_row):
                d = divisors[band * per_row + j]
                if d > 0:
                    first = at + np.uint64(j) * tc
                    for c in range(tile_cols):
                        out[first + np.uint64(c)] /= d
