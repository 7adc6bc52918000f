"""Linear algebra whose result is the same bit for bit on every IEEE-754 machine.

Library matrix products (BLAS, cuBLAS) sum in an order that depends on the device, the thread
count and the blocking, so two honest nodes can round differently. Whatever every node must
compute identically from a window's aggregate (DeMo's inverse DCT, GreedyLore's reconstruction
and its subspace) goes through this module instead, built from elementwise operations only:

* products are formed elementwise in float64, correctly rounded (exact for float32 inputs);
* sums run as a fixed pairwise tree over the reduced axis (pad to a power of two with zeros, then
  add the upper half onto the lower half until one slice is left), never fused with a product.

Every elementwise operation is correctly rounded by IEEE-754, so the order of roundings — and
with it the result — is fixed by this code alone. The cost is memory traffic: work is blocked so
no temporary exceeds `BLOCK_ELEMENTS` float64 values.
"""

from __future__ import annotations

import math

import torch

__all__ = ["BLOCK_ELEMENTS", "det_matmul", "tree_sum"]

BLOCK_ELEMENTS = 1 << 23
"""Largest float64 temporary (64 MiB) a product may build at once."""


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum of float64 ``x`` over ``dim`` in a fixed pairwise order (the axis is dropped)."""
    x = x.movedim(dim, -1)
    n = x.shape[-1]
    if n == 0:
        return torch.zeros(x.shape[:-1], dtype=x.dtype, device=x.device)
    width = 1 << math.ceil(math.log2(n)) if n > 1 else 1
    if width != n:
        x = torch.nn.functional.pad(x, (0, width - n))
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def det_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in float64 with a fixed order of roundings: (..., m, k) @ (k, n) or batched
    (..., m, k) @ (..., k, n) with equal batch shapes. Inputs are converted to float64."""
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    if b64.dim() == 2:
        b64 = b64.expand(*a64.shape[:-2], *b64.shape)
    if a64.shape[:-2] != b64.shape[:-2] or a64.shape[-1] != b64.shape[-2]:
        raise ValueError(f"cannot multiply {tuple(a.shape)} by {tuple(b.shape)}")
    batch, (m, k), n = a64.shape[:-2], a64.shape[-2:], b64.shape[-1]
    a3 = a64.reshape(-1, m, k)
    b3 = b64.reshape(-1, k, n)
    out = torch.empty(a3.shape[0], m, n, dtype=torch.float64, device=a64.device)
    items = BLOCK_ELEMENTS // max(1, m * k * n)
    if items >= 1:  # whole products, several at a time
        for i in range(0, a3.shape[0], items):
            block = a3[i : i + items, :, :, None] * b3[i : i + items, None, :, :]
            out[i : i + items] = tree_sum(block, 2)
    else:  # one product, a few rows at a time
        rows = max(1, BLOCK_ELEMENTS // max(1, k * n))
        for i in range(a3.shape[0]):
            for r in range(0, m, rows):
                block = a3[i, r : r + rows, :, None] * b3[i, None, :, :]
                out[i, r : r + rows] = tree_sum(block, 1)
    return out.reshape(*batch, m, n)
