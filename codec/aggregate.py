"""Mean of the peers' decoded updates, reproducible bit for bit on every honest node.

Updates are taken in ascending order of their peer key, never in arrival order. Each peer's
decoded values are (optionally) multiplied by a clip factor and added into float32 buffers with
one rounding per position and peer; the sum is then divided by the number of peers (with
clipping: by `mean_divisor`, where a null update counts 0). Peer norms
are computed without any float reduction whose order could depend on threads or device: a
chunk holds only two magnitudes, so its squared norm is ``n_low * low**2 + n_high * high**2``
in float64 (elementwise, the squares exact), and the chunks are summed with `math.fsum`
(correctly rounded), so every node derives the same clip factors.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from codec.compress import SparseTensor, scatter_add
from codec.errors import DecodeError
from codec.quantize import chunk_levels
from codec.spec import CodecParams, ModelSpec

__all__ = [
    "aggregate",
    "clip_bound",
    "clip_factors",
    "divide_exactly",
    "mean_divisor",
    "norm_partials",
    "update_norm",
]

Update = Sequence[SparseTensor]


def norm_partials(update: Update) -> list[float]:
    """Each chunk's squared L2 norm (float64, elementwise exact squares) over the given pieces.
    `math.fsum` of the partials of all of an update's pieces, split any way, is its squared norm
    exactly rounded: workers that each hold a share of the tensors (`codec.pool`) get the same
    norm as `update_norm`."""
    partials: list[float] = []
    for sparse in update:
        for g in sparse.groups:
            levels = chunk_levels(g.scales, sparse.codebook).double().square()
            n_high = (g.codes >> 1).sum(1, dtype=torch.int64).double()
            n_low = g.codes.shape[1] - n_high
            partials.extend((n_low * levels[:, 0] + n_high * levels[:, 1]).tolist())
    return partials


def update_norm(update: Update) -> float:
    """L2 norm of a peer's decoded update over all its tensors (order-free, exactly rounded sum)."""
    return math.sqrt(math.fsum(norm_partials(update)))


def clip_bound(norms: Sequence[float]) -> float:
    """The norm every update is clipped to: the lower median, ``sorted(norms)[(N - 1) // 2]``.

    At least ``N - (N - 1) // 2 > N / 2`` of the norms are at or above it and at least
    ``(N - 1) // 2 + 1 >= N / 2`` at or below it, so raising it above every honest norm takes a
    strict majority of the set (half is not enough, for even and odd ``N``). 0 with no norms.
    """
    if not norms:
        return 0.0
    return sorted(norms)[(len(norms) - 1) // 2]


def clip_factors(norms: Sequence[float]) -> list[float]:
    """Per update ``min(1, bound / norm)`` with `clip_bound`'s bound. A zero norm keeps 1."""
    bound = clip_bound(norms)
    return [1.0 if n <= bound else bound / n for n in norms]


def mean_divisor(norms: Sequence[float]) -> float:
    """What the clipped sum is divided by: each update counts ``min(norm, bound) / bound``, so a
    null update (norm 0) counts 0 and a tiny one almost 0, and neither dilutes the step; an
    update at or above the bound counts 1. Exactly rounded (`math.fsum`), the same on every node;
    0 when every norm is 0 (the sum is then zero and left as it is)."""
    bound = clip_bound(norms)
    if bound <= 0:
        return 0.0
    return math.fsum(min(n, bound) / bound for n in norms)


def divide_exactly(t: torch.Tensor, divisor: float) -> None:
    """``t /= divisor`` in place, one correctly rounded float32 division per element on any
    device. The divisor goes in as a float32 tensor on ``t``'s device: with a Python number CUDA
    multiplies by its reciprocal instead, which rounds differently from the CPU's division."""
    t.div_(torch.tensor(divisor, dtype=torch.float32, device=t.device))


def _by_name(update: Update, by_shape: Mapping[str, tuple[int, ...]]) -> dict[str, SparseTensor]:
    out: dict[str, SparseTensor] = {}
    for sparse in update:
        if sparse.name in out:
            raise DecodeError(f"tensor {sparse.name!r} appears twice in one update")
        if sparse.name not in by_shape:
            raise DecodeError(f"unknown tensor {sparse.name!r}")
        if tuple(sparse.shape) != by_shape[sparse.name]:
            raise DecodeError(f"{sparse.name}: shape {sparse.shape} != {by_shape[sparse.name]}")
        out[sparse.name] = sparse
    return out


def aggregate(
    updates: Mapping[Any, Update],  # keys of one sortable type (uids)
    spec: ModelSpec,
    params: CodecParams,
    clip_to_median: bool = False,
    device: torch.device | str = "cpu",
    validate: bool = True,
    triton: bool | None = None,
) -> dict[str, torch.Tensor]:
    """Mean dense float32 update per tensor of ``spec`` over the peers in ``updates``.

    ``updates`` maps a peer key (all keys mutually comparable, e.g. all ``str``) to that peer's
    list of `SparseTensor`. A tensor a peer did not send counts as zero for that peer. With
    ``clip_to_median`` each peer's update is first scaled to at most the lower median peer norm
    (`clip_bound`) and the sum divided by `mean_divisor` (null updates do not count).
    With ``validate`` every update is checked first (`DecodeError` on malformed input).
    The result does not depend on the order of ``updates``; with no peers it is all zeros.
    On a CUDA ``device`` the scatter-adds run as a Triton kernel (`codec.gpu.scatter`), with the
    same result bit for bit; ``triton`` forces (True) or forbids (False) that.
    """
    by_shape = {t.name: tuple(t.shape) for t in spec.tensors}
    keys = sorted(updates)
    peers = [_by_name(updates[key], by_shape) for key in keys]
    if validate:
        for peer in peers:
            for sparse in peer.values():
                sparse.validate(params)
    if clip_to_median:
        norms = [update_norm(list(p.values())) for p in peers]
        factors, divisor = clip_factors(norms), mean_divisor(norms)
    else:
        factors, divisor = [1.0] * len(peers), float(len(peers))
    out = {t.name: torch.zeros(t.shape, dtype=torch.float32, device=device) for t in spec.tensors}
    for peer, factor in zip(peers, factors, strict=True):
        for name, sparse in peer.items():
            scatter_add(out[name], sparse, params, factor, triton)
    if divisor > 0:
        for t in out.values():
            divide_exactly(t, divisor)
    return out
