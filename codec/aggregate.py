"""Mean of the peers' decoded updates, reproducible bit for bit on every honest node.

Updates are taken in ascending order of their peer key, never in arrival order. Each peer's
decoded values are (optionally) multiplied by a clip factor and added into float32 buffers with
one rounding per position and peer; the sum is then divided by the number of peers. Peer norms
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

__all__ = ["aggregate", "clip_factors", "update_norm"]

Update = Sequence[SparseTensor]


def update_norm(update: Update) -> float:
    """L2 norm of a peer's decoded update over all its tensors (order-free, exactly rounded sum)."""
    partials: list[float] = []
    for sparse in update:
        for g in sparse.groups:
            levels = chunk_levels(g.scales, sparse.codebook).double().square()
            n_high = (g.codes >> 1).sum(1, dtype=torch.int64).double()
            n_low = g.codes.shape[1] - n_high
            partials.extend((n_low * levels[:, 0] + n_high * levels[:, 1]).tolist())
    return math.sqrt(math.fsum(partials))


def clip_factors(norms: Sequence[float]) -> list[float]:
    """Per peer ``min(1, median / norm)``: scales every update down to at most the median norm.

    The median of an even count is the mean of the two middle norms. A zero norm keeps factor 1.
    """
    if not norms:
        return []
    ordered = sorted(norms)
    mid = len(ordered) // 2
    median = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return [1.0 if n <= median else median / n for n in norms]


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
    ``clip_to_median`` each peer's update is first scaled to at most the median peer norm.
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
    factors = (
        clip_factors([update_norm(list(p.values())) for p in peers])
        if clip_to_median
        else [1.0] * len(peers)
    )
    out = {t.name: torch.zeros(t.shape, dtype=torch.float32, device=device) for t in spec.tensors}
    for peer, factor in zip(peers, factors, strict=True):
        for name, sparse in peer.items():
            scatter_add(out[name], sparse, params, factor, triton)
    if peers:
        for t in out.values():
            t.div_(len(peers))
    return out
