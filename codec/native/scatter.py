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

__all__ = ["scatter_group"]

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
