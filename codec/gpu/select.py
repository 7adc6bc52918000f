"""Error feedback and exact per-chunk Top-k of one chunk group: one program per chunk.

Each program reads its chunk of the pseudo-gradient through the group's tile geometry (no copy
of the tensor), folds it into the chunk's row of the EF buffer (``e <- beta * e + delta`` as one
FMA, the rounding of the CPU path's ``torch.add(delta, e, alpha=beta)``; during the EF freeze
``e`` is left alone and ``delta`` itself is selected), and selects the chunk's k entries of
largest ``|e|`` exactly:

* the k-th largest ``|e|`` is found by bisection on its float32 bit pattern (non-negative
  floats order like their bit patterns), 31 counting passes over the chunk held in registers;
* every entry above it is kept, then the lowest positions among those equal to it, until k —
  the CPU path's tie rule;
* a prefix sum over the kept mask gives each kept entry its output slot, so positions come out
  ascending, with their signed values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from codec.chunking import ChunkLayout

__all__ = ["select"]


@triton.jit
def _select_kernel(
    delta_ptr,
    ef_ptr,
    idx_ptr,
    vals_ptr,
    beta,
    chunk,
    k,
    grid_cols,
    tile_rows,
    tile_cols,
    origin,
    cols,
    FREEZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    ch = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK)
    live = p < chunk
    row = (ch // grid_cols) * tile_rows + p // tile_cols
    src = origin + row * cols + (ch % grid_cols) * tile_cols + p % tile_cols
    x = tl.load(delta_ptr + src, mask=live, other=0.0).to(tl.float32)
    if not FREEZE:
        e = tl.load(ef_ptr + ch * chunk + p, mask=live, other=0.0)
        x = tl.fma(e, beta, x)
        tl.store(ef_ptr + ch * chunk + p, x, mask=live)
    bits = tl.where(live, tl.abs(x).to(tl.int32, bitcast=True), -1)
    t = tl.sum(tl.zeros_like(bits), 0)  # the threshold's bit pattern, built from the top bit
    for b in tl.static_range(30, -1, -1):
        cand = t | (1 << b)
        t = tl.where(tl.sum((bits >= cand).to(tl.int32), 0) >= k, cand, t)
    above = bits > t
    tied = (bits == t).to(tl.int32)
    need = k - tl.sum(above.to(tl.int32), 0)
    keep = above | ((tied == 1) & (tl.cumsum(tied, 0) - tied < need))
    kept = keep.to(tl.int32)
    slot = tl.cumsum(kept, 0) - kept
    tl.store(idx_ptr + ch * k + slot, p.to(tl.int64), mask=keep)
    tl.store(vals_ptr + ch * k + slot, x, mask=keep)


def select(
    delta: torch.Tensor,
    ef: torch.Tensor,
    layout: ChunkLayout,
    group_index: int,
    beta: float,
    freeze: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64 (n, k) ascending, values float32 (n, k)) of a group's chunks; updates
    the group's EF rows ``ef`` (n, chunk) in place unless ``freeze``."""
    g = layout.groups[group_index]
    dev = ef.device
    idx = torch.empty(g.n_chunks, g.k, dtype=torch.int64, device=dev)
    vals = torch.empty(g.n_chunks, g.k, dtype=torch.float32, device=dev)
    if g.n_chunks == 0:
        return idx, vals
    (r0, c0), (_, b), (c, d) = g.origin, g.grid, g.tile
    _select_kernel[(g.n_chunks,)](
        delta,
        ef,
        idx,
        vals,
        float(torch.tensor(beta, dtype=torch.float32)),
        g.chunk_size,
        g.k,
        b,
        c,
        d,
        r0 * layout.cols + c0,
        layout.cols,
        FREEZE=freeze,
        BLOCK=triton.next_power_of_2(g.chunk_size),
        num_warps=8,
    )
    return idx, vals
