"""Per-chunk orthonormal DCT-II (DeMo): every chunk of a tensor's `ChunkLayout` is transformed on
its own, in place of its elements.

A chunk is a ``a x b`` tile (``1 x n`` for a 1-D chunk), and its coefficients are
``C = P_a X P_b^T`` with ``P_n[u, i] = c_u cos(pi (2 i + 1) u / (2 n))``, ``c_0 = sqrt(1/n)``,
``c_u = sqrt(2/n)`` otherwise: orthonormal, so the inverse is ``X = P_a^T C P_b`` and L2 norms
are the same in both domains. The coefficient tensor has the tensor's own shape: coefficient
``(u, v)`` of a tile sits where element ``(u, v)`` of that tile sits, so every chunk-layout tool
(`codec.compress.Compressor`, the index coder, `codec.compress.scatter_add`) works on it as is.

**Determinism.** The sender's forward transform may round however its device likes (only the
sender computes it). The inverse of a window's aggregate is computed by every node and must be
identical: it runs through `codec.detmath` (float64, fixed order) and rounds once to float32, and
the matrices ``P_n`` are the same float32 numbers everywhere: each entry is computed in float64
(``math.cos`` is within one float64 ulp of the true value on any IEEE libm) and rounded to
float32 only if it lies at least `_MARGIN` (relative) away from a float32 rounding boundary, far
more than any libm's error, so every machine rounds it the same way (`dct_matrix` raises
otherwise; no size a model uses comes near).
"""

from __future__ import annotations

import math
from functools import lru_cache

import numpy as np
import torch

from codec.chunking import ChunkLayout
from codec.detmath import det_matmul

__all__ = ["dct_matrix", "forward", "inverse"]

_MARGIN = 2.0**-40


def _to_f32_safely(x: np.ndarray) -> np.ndarray:
    """float64 ``x`` rounded to float32, refusing entries too near a rounding boundary."""
    r = x.astype(np.float32)
    toward = np.where(r.astype(np.float64) < x, np.float32(np.inf), np.float32(-np.inf))
    boundary = (r.astype(np.float64) + np.nextafter(r, toward).astype(np.float64)) / 2
    inexact = r.astype(np.float64) != x
    if bool((inexact & (np.abs(x - boundary) <= _MARGIN * np.abs(x))).any()):
        raise ArithmeticError("a DCT entry is too close to a float32 rounding boundary")
    return r


@lru_cache(maxsize=64)
def _matrix(n: int) -> torch.Tensor:
    if n < 1:
        raise ValueError(f"DCT size must be positive, got {n}")
    angle = np.arange(4 * n, dtype=np.int64)  # cos(pi * m / (2n)) takes 4n values only
    cos = np.where(angle % (2 * n) == n, 0.0, np.cos(np.pi * angle / (2 * n)))  # exact at pi/2
    table = np.stack([_to_f32_safely(math.sqrt(c / n) * cos) for c in (1.0, 2.0)])
    u = np.arange(n, dtype=np.int64)[:, None]
    m = ((2 * np.arange(n, dtype=np.int64)[None, :] + 1) * u) % (4 * n)  # exact, in integers
    return torch.from_numpy(np.ascontiguousarray(table[(u > 0).astype(np.int64), m]))


def dct_matrix(n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The float32 orthonormal DCT-II matrix ``P_n`` (rows are frequencies), identical on every
    machine. Cached; do not modify the result."""
    return _matrix(n).to(device)


def forward(x: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The per-chunk DCT coefficients of ``x`` (float32, in ``x``'s shape; see module docstring)."""
    x = x.detach().to(torch.float32).contiguous()
    out = torch.empty_like(x)
    for gi, g in enumerate(layout.groups):
        pa, pb = dct_matrix(g.tile[0], x.device), dct_matrix(g.tile[1], x.device)
        layout.group_view(out, gi).copy_(pa @ layout.group_view(x, gi) @ pb.T)
    return out


def inverse(coef: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """The tensor whose per-chunk DCT is ``coef``, float32, the same bits on every machine."""
    coef = coef.detach().to(torch.float32).contiguous()
    out = torch.empty_like(coef)
    for gi, g in enumerate(layout.groups):
        a, b = g.tile
        pa, pb = dct_matrix(a, coef.device), dct_matrix(b, coef.device)
        tiles = layout.group_view(coef, gi).reshape(-1, a, b)
        left = det_matmul(pa.T.expand(tiles.shape[0], a, a), tiles)
        x = det_matmul(left, pb.expand(tiles.shape[0], b, b))
        layout.group_view(out, gi).copy_(x.to(torch.float32).view(*g.grid, a, b))
    return out
