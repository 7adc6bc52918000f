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
    shift, stride, tc = _tile_shift(tile_cols), np.uint64(cols), np.uint64(tile_cols)
    for ch in range(idx.shape[0]):
        first = np.uint64(
            (r0 + (ch // per_row) * tile_rows) * cols + c0 + (ch % per_row) * tile_cols
        )
        low, high = _levels(scales[ch], codebook, lut)
        _add_chunk(out, first, stride, tc, shift, idx[ch], codes[ch], low, high, factor[ch])


@numba.njit(cache=True, nogil=True, inline="always")
def _tile_shift(tile_cols: int) -> int:
    """log2 of ``tile_cols`` when it is a power of two (positions split with a shift and a
    mask), else -1 (a division)."""
    if tile_cols & (tile_cols - 1):
        return -1
    shift = 0
    while 1 << shift < tile_cols:
        shift += 1
    return shift


@numba.njit(cache=True, nogil=True, inline="always")
def _levels(side: int, codebook: np.ndarray, lut: np.ndarray) -> tuple[float, float]:
    """A chunk's two magnitudes from its side byte: the codebook row times the scale."""
    scale = lut[side >> 2]
    row = side & 3
    return codebook[row, 0] * scale, codebook[row, 1] * scale


@numba.njit(cache=True, nogil=True, inline="always")
def _add_chunk(
    out: np.ndarray, first: np.uint64, stride: np.uint64, tc: np.uint64, shift: int, idx: np.ndarray, codes: np.ndarray, low: float, high: float, f: float,
) -> None:  # fmt: skip
    """``out += ±level · f`` at each of one chunk's entries (its row of ``idx`` and ``codes``),
    the chunk's first element at ``first``; offsets unsigned (no negative-index handling)."""
    for e in range(idx.shape[0]):
        p = np.uint64(idx[e])
        if shift >= 0:
            at = first + (p >> np.uint64(shift)) * stride + (p & (tc - np.uint64(1)))
        else:
            at = first + (p // tc) * stride + p % tc
        c = codes[e]
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
    updates, n, _ = idx.shape
    if n == 0:
        return
    shift, stride, tc = _tile_shift(tile_cols), np.uint64(cols), np.uint64(tile_cols)
    width = np.uint64(per_row * tile_cols)
    for band in range(n // per_row):
        start = np.uint64((r0 + band * tile_rows) * cols + c0)
        for r in range(tile_rows):
            at = start + np.uint64(r) * stride
            for c in range(width):
                out[at + np.uint64(c)] = 0.0
        for u in range(updates):
            for j in range(per_row):
                ch = band * per_row + j
                low, high = _levels(scales[u, ch], codebooks[u], lut)
                first = start + np.uint64(j) * tc
                _add_chunk(
                    out,
                    first,
                    stride,
                    tc,
                    shift,
                    idx[u, ch],
                    codes[u, ch],
                    low,
                    high,
                    factors[u, ch],
                )
        for r in range(tile_rows):
            at = start + np.uint64(r) * stride
            for j in range(per_row):
                d = divisors[band * per_row + j]
                if d > 0:
                    first = at + np.uint64(j) * tc
                    for c in range(tile_cols):
                        out[first + np.uint64(c)] /= d
