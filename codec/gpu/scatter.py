"""Dequantisation fused with the scatter of an update: into a dense tensor, or into EF buffers.

`scatter_add` adds ``factor * decoded`` into a dense float32 tensor: one program per block of
kept entries, each entry read, dequantised (``S_j * L[r_j, b]``, sign applied), multiplied by
its chunk's float32 factor and added at its flat position. Positions of one update are unique, so no two
programs touch the same element, and each element gets exactly the CPU path's two float32
roundings (product, then sum; contraction into an FMA is switched off). Updates are applied
one launch at a time in the caller's (sorted) order: the aggregate is the CPU aggregate bit for
bit.

`feedback` writes ``kept - decoded`` into the chunk rows of an error-feedback buffer (the
quantisation error stays in e), the same float32 subtraction as the CPU path's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codec.chunking import ChunkLayout
from codec.quantize import SCALE_LUT

__all__ = ["feedback", "scatter_add"]

BLOCK = 1024
LAUNCH_OPTIONS = {"enable_fp_fusion": False}
"""No contraction of ``a + b * c`` into an FMA: the CPU path rounds the product and the sum."""


@triton.jit
def _dequant(code, side, book_ptr, lut_ptr):
    """Decoded value of 2-bit `code` in a chunk with side byte `side` (see codec.quantize)."""
    scale = tl.load(lut_ptr + (side >> 2))
    level = tl.load(book_ptr + (side & 3) * 2 + (code >> 1))
    mag = level * scale  # the product `chunk_levels` makes
    return tl.where((code & 1) == 1, -mag, mag)


@triton.jit
def _scatter_add_kernel(
    out_ptr,
    idx_ptr,
    codes_ptr,
    scales_ptr,
    book_ptr,
    lut_ptr,
    factor_ptr,
    total,
    k,
    grid_cols,
    tile_rows,
    tile_cols,
    origin,
    cols,
    BLOCK: tl.constexpr,
):
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = e < total
    ch = e // k
    pos = tl.load(idx_ptr + e, mask=live, other=0)
    code = tl.load(codes_ptr + e, mask=live, other=0).to(tl.int32)
    side = tl.load(scales_ptr + ch, mask=live, other=0).to(tl.int32)
    v = _dequant(code, side, book_ptr, lut_ptr)
    factor = tl.load(factor_ptr + ch, mask=live, other=0.0)
    row = (ch // grid_cols) * tile_rows + pos // tile_cols
    flat = origin + row * cols + (ch % grid_cols) * tile_cols + pos % tile_cols
    cur = tl.load(out_ptr + flat, mask=live, other=0.0)
    tl.store(out_ptr + flat, cur + v * factor, mask=live)


@triton.jit
def _feedback_kernel(
    ef_ptr, idx_ptr, vals_ptr, codes_ptr, scales_ptr, book_ptr, lut_ptr, total, k, chunk,
    BLOCK: tl.constexpr,
):  # fmt: skip
    e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    live = e < total
    ch = e // k
    pos = tl.load(idx_ptr + e, mask=live, other=0)
    code = tl.load(codes_ptr + e, mask=live, other=0).to(tl.int32)
    side = tl.load(scales_ptr + ch, mask=live, other=0).to(tl.int32)
    kept = tl.load(vals_ptr + e, mask=live, other=0.0)
    v = _dequant(code, side, book_ptr, lut_ptr)
    tl.store(ef_ptr + ch * chunk + pos, kept - v, mask=live)


def _lut(device: torch.device) -> torch.Tensor:
    return SCALE_LUT.to(device)


def scatter_add(
    out: torch.Tensor,
    layout: ChunkLayout,
    group_index: int,
    idx: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    codebook: torch.Tensor,
    factor: torch.Tensor,
) -> None:
    """``out.view(-1)[positions] += factor[chunk] * decoded`` for one chunk group (inputs
    trusted; ``factor`` float32 (n_chunks,))."""
    g = layout.groups[group_index]
    total = g.n_chunks * g.k
    if total == 0:
        return
    dev = out.device
    (r0, c0), (_, b), (c, d) = g.origin, g.grid, g.tile
    _scatter_add_kernel[(triton.cdiv(total, BLOCK),)](
        out,
        idx.to(dev, torch.int64).contiguous(),
        codes.to(dev, torch.uint8).contiguous(),
        scales.to(dev, torch.uint8).contiguous(),
        codebook.to(dev, torch.float32).contiguous(),
        _lut(dev),
        factor.to(dev, torch.float32).contiguous(),
        total,
        g.k,
        b,
        c,
        d,
        r0 * layout.cols + c0,
        layout.cols,
        BLOCK=BLOCK,
        **LAUNCH_OPTIONS,
    )


def feedback(
    buf: torch.Tensor,
    idx: torch.Tensor,
    kept: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    codebook: torch.Tensor,
) -> None:
    """``buf[i, idx[i]] = kept[i] - decoded[i]`` for the (n_chunks, chunk) rows of an EF buffer."""
    total = idx.numel()
    if total == 0:
        return
    dev = buf.device
    _feedback_kernel[(triton.cdiv(total, BLOCK),)](
        buf,
        idx.contiguous(),
        kept.contiguous(),
        codes.to(dev, torch.uint8).contiguous(),
        scales.to(dev, torch.uint8).contiguous(),
        codebook.to(dev, torch.float32).contiguous(),
        _lut(dev),
        total,
        idx.shape[1],
        buf.shape[1],
        BLOCK=BLOCK,
        **LAUNCH_OPTIONS,
    )
