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

__all__ = ["BLOCK_ELEMENTS", "JACOBI_SWEEPS", "det_eigh", "det_matmul", "tree_sum"]

BLOCK_ELEMENTS = 1 << 23
"""Largest float64 temporary (64 MiB) a product may build at once."""

JACOBI_SWEEPS = 8
"""Sweeps of `det_eigh`: a fixed count (no data-dependent stop). Eight leave a relative eigen-
residual near 1e-10 on 128 x 128 Gram matrices, far below what a compression basis needs."""


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


def _round_robin(m: int) -> list[tuple[list[int], list[int]]]:
    """``m - 1`` rounds of ``m / 2`` disjoint pairs covering every pair once (``m`` even)."""
    players = list(range(m))
    rounds = []
    for _ in range(m - 1):
        half = m // 2
        rounds.append((players[:half], players[half:][::-1]))
        players = [players[0], players[-1], *players[1:-1]]
    return rounds


def _rotate(x: torch.Tensor, p: torch.Tensor, q: torch.Tensor, c: torch.Tensor,
            s: torch.Tensor, dim: int) -> None:  # fmt: skip
    """Columns (dim -1) or rows (dim -2) ``p, q`` of ``x`` become ``c p - s q`` and ``s p + c q``."""
    xp, xq = x.index_select(dim, p), x.index_select(dim, q)
    new_p = c * xp - s * xq
    new_q = s * xp + c * xq
    x.index_copy_(dim, p, new_p)
    x.index_copy_(dim, q, new_q)


def det_eigh(sym: torch.Tensor, sweeps: int = JACOBI_SWEEPS) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigen-decomposition of symmetric (..., m, m) matrices, the same bits on every machine:
    (eigenvalues descending (..., m), orthonormal eigenvectors as columns (..., m, m)), float64.

    Parallel cyclic Jacobi: ``sweeps`` sweeps of ``m - 1`` rounds; each round rotates ``m / 2``
    disjoint coordinate pairs at once (round-robin order) to zero their off-diagonal entries,
    applied to rows and columns with elementwise operations only. Ties between eigenvalues keep
    their index order.
    """
    a = sym.to(torch.float64).clone()
    m = a.shape[-1]
    if m % 2:  # one decoupled zero coordinate makes the count even; it never rotates
        a = torch.nn.functional.pad(a, (0, 1, 0, 1))
    size = a.shape[-1]
    v = torch.eye(size, dtype=torch.float64, device=a.device).expand_as(a).clone()
    rounds = [
        (torch.tensor(p, device=a.device), torch.tensor(q, device=a.device))
        for p, q in _round_robin(size)
    ]
    for _ in range(sweeps if size > 1 else 0):
        for p, q in rounds:
            app = a[..., p, p]
            aqq = a[..., q, q]
            apq = a[..., p, q]
            live = apq != 0
            theta = (aqq - app) / torch.where(live, 2 * apq, 1.0)
            big = theta.abs() > 1e150  # theta**2 would overflow: t ~ 1 / (2 theta)
            root = torch.sqrt(torch.where(big, 1.0, theta * theta) + 1.0)
            t = torch.where(big, 0.5 / theta, torch.sign(theta) / (theta.abs() + root))
            t = torch.where(theta == 0, 1.0, t)
            t = torch.where(live, t, 0.0)
            c = 1.0 / torch.sqrt(t * t + 1.0)
            s = t * c
            _rotate(a, p, q, c[..., None, :], s[..., None, :], -1)
            _rotate(a, p, q, c[..., :, None], s[..., :, None], -2)
            _rotate(v, p, q, c[..., None, :], s[..., None, :], -1)
    values = torch.diagonal(a, dim1=-2, dim2=-1)[..., :m]
    order = torch.argsort(-values, dim=-1, stable=True)
    vectors = torch.gather(v[..., :m, :m], -1, order[..., None, :].expand(*v.shape[:-2], m, m))
    return torch.gather(values, -1, order), vectors
