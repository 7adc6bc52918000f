"""Mean of the peers' decoded updates, reproducible bit for bit on every honest node.

Updates are taken in ascending order of their peer key, never in arrival order. Each peer's
decoded values are (optionally) multiplied by a clip factor and added into float32 buffers with
one rounding per position and peer; the sum is then divided by the number of peers (with
clipping: by a divisor in which a null update counts 0). Norms are computed without any float
reduction whose order could depend on threads or device: a chunk holds only two magnitudes, so
its squared norm is ``n_low * low**2 + n_high * high**2`` in float64 (elementwise, the squares
exact), and a whole update's chunks are summed with `math.fsum` (correctly rounded), so every
node derives the same factors.

Two clip rules (docs/consensus.md, "What the bound is"):

* **per update** (`clip_factors`, `mean_divisor`): each update scaled to at most the lower median
  of the updates' norms; the rule of strategies whose pieces have no chunks;
* **per chunk** (`chunk_clip`): in every chunk, each update's part scaled to at most the lower
  median of the updates' norms in that chunk, and the chunk's sum divided by its own count
  (`divide_chunks`). No update teaches any chunk more than the median update does there, so one
  update cannot concentrate its whole norm on the few chunks a targeted change (a backdoor)
  needs; the rule of every chunked sparse strategy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from codec.chunking import ChunkLayout
from codec.compress import SparseTensor, scatter_add
from codec.errors import DecodeError
from codec.quantize import chunk_levels
from codec.spec import CodecParams, ModelSpec

__all__ = [
    "ChunkClip",
    "add_support",
    "aggregate",
    "chunk_clip",
    "chunk_norms",
    "clip_bound",
    "clip_factors",
    "divide_chunks",
    "divide_exactly",
    "keep_supported",
    "mean_divisor",
    "sum_clipped",
    "update_norm",
]

Update = Sequence[SparseTensor]


def chunk_norms(piece: Any) -> list[torch.Tensor]:
    """Each chunk's squared L2 norm, one float64 tensor per chunk group of a sparse piece (any
    piece with ``groups`` of ``codes`` and ``scales`` and a ``codebook``), elementwise exact."""
    out = []
    for g in piece.groups:
        levels = chunk_levels(g.scales, piece.codebook).double().square()
        n_high = (g.codes >> 1).sum(1, dtype=torch.int64).double()
        n_low = g.codes.shape[1] - n_high
        out.append(n_low * levels[:, 0] + n_high * levels[:, 1])
    return out


def update_norm(update: Update) -> float:
    """L2 norm of a peer's decoded update over all its tensors (order-free, exactly rounded sum)."""
    return math.sqrt(
        math.fsum(x for piece in update for g in chunk_norms(piece) for x in g.tolist())
    )


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


@dataclass(frozen=True)
class ChunkClip:
    """The per-chunk clip of one tensor over a window's updates (`chunk_clip`)."""

    factors: list[list[torch.Tensor] | None]
    """Per update (ascending key order), per chunk group: float32 (n_chunks,) factors; None for
    an update that does not send the tensor."""
    divisors: list[torch.Tensor]
    """Per chunk group: float32 (n_chunks,), what each chunk's sum is divided by (0: leave it)."""


def chunk_clip(
    norms: Sequence[Sequence[torch.Tensor] | None], n_chunks: Sequence[int]
) -> ChunkClip:
    """The clip of one tensor, chunk by chunk, from each update's `chunk_norms` of it (None for
    an update without it: a zero norm everywhere), in ascending key order.

    In each chunk the bound is the lower median of the updates' norms there (`clip_bound`'s
    rule: only a strict majority lifts it above every honest norm), each update's part is scaled
    by ``min(1, bound / norm)``, and the chunk's sum is divided by the updates' count in which
    each counts ``min(norm, bound) / bound`` (a null part counts 0, as `mean_divisor`). Every
    operation is elementwise in float64 with correctly rounded square roots and divisions, the
    count summed in key order: the same on every node. The factors and divisors are rounded to
    float32 once."""
    factors: list[list[torch.Tensor]] = [[] for _ in norms]
    divisors = []
    for gi, n in enumerate(n_chunks):
        zero = torch.zeros(n, dtype=torch.float64)
        sq = torch.stack([zero if u is None else u[gi].double() for u in norms]) if norms else None
        if sq is None:
            divisors.append(zero.float())
            continue
        bound_sq = sq.sort(0).values[(sq.shape[0] - 1) // 2]
        scaled = (bound_sq / torch.where(sq > 0, sq, 1.0)).sqrt()
        factor = torch.where(sq <= bound_sq, 1.0, scaled)
        bound, norm = bound_sq.sqrt(), sq.sqrt()
        count = torch.zeros(n, dtype=torch.float64)
        for i in range(sq.shape[0]):  # in key order: one rounding per update, as on every node
            count += torch.minimum(norm[i], bound) / torch.where(bound > 0, bound, 1.0)
        divisors.append(torch.where(bound > 0, count, 0.0).float())
        for i in range(sq.shape[0]):
            factors[i].append(factor[i].float())
    return ChunkClip(
        [None if u is None else f for u, f in zip(norms, factors, strict=True)], divisors
    )


def divide_chunks(t: torch.Tensor, layout: ChunkLayout, divisors: Sequence[torch.Tensor]) -> None:
    """Each chunk of ``t`` divided in place by its divisor (`ChunkClip.divisors`), one correctly
    rounded float32 division per element on any device; a chunk whose divisor is 0 is left as
    it is (its sum is 0)."""
    for gi, (g, d) in enumerate(zip(layout.groups, divisors, strict=True)):
        d = d.to(t.device, torch.float32)
        view = layout.group_view(t, gi)
        view.div_(torch.where(d > 0, d, 1.0).view(g.grid[0], g.grid[1], 1, 1))


def add_support(count: torch.Tensor, positions: torch.Tensor, values: torch.Tensor) -> None:
    """Count one update in ``count`` (uint8, saturating at 255) at the flat positions where it
    sends a nonzero value (positions of one update are unique)."""
    flat = count.view(-1)
    at = positions.to(count.device)[values.to(count.device) != 0]
    flat[at] = (flat[at].to(torch.int16) + 1).clamp(max=255).to(torch.uint8)


def keep_supported(t: torch.Tensor, count: torch.Tensor, min_support: int) -> None:
    """Zero the coordinates of ``t`` that fewer than ``min_support`` updates sent
    (``outer.min_support``: a lone update cannot move what no other update moves)."""
    t.masked_fill_(count.to(t.device) < min_support, 0.0)


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
    min_support: int = 1,
) -> dict[str, torch.Tensor]:
    """Mean dense float32 update per tensor of ``spec`` over the peers in ``updates``.

    ``updates`` maps a peer key (all keys mutually comparable, e.g. all ``str``) to that peer's
    list of `SparseTensor`. A tensor a peer did not send counts as zero for that peer. With
    ``clip_to_median`` the rule is per chunk (`sum_clipped`, `chunk_clip`), and ``min_support``
    (``outer.min_support``) zeroes what fewer updates sent.
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
    out = {t.name: torch.zeros(t.shape, dtype=torch.float32, device=device) for t in spec.tensors}
    if clip_to_median:
        for name, dense in out.items():
            sum_clipped(dense, [p.get(name) for p in peers], params, triton, min_support)
        return out
    for peer in peers:
        for name, sparse in peer.items():
            scatter_add(out[name], sparse, params, 1.0, triton)
    if peers:
        for dense in out.values():
            divide_exactly(dense, float(len(peers)))
    return out


def sum_clipped(
    out: torch.Tensor,
    pieces: Sequence[SparseTensor | None],
    params: CodecParams,
    triton: bool | None = None,
    min_support: int = 1,
) -> None:
    """``out`` becomes (whatever it held) the per-chunk clipped mean of one tensor's pieces, in
    the given (ascending key) order, None for an update without the tensor (`chunk_clip`); with
    ``min_support`` above 1, zero where fewer updates sent a value (`keep_supported`). On the CPU
    each chunk is zeroed, summed and divided while it is in cache (`codec.native.scatter.
    mean_group`), with the same result bit for bit as the steps one after another below."""
    layout = ChunkLayout.for_shape(out.shape, params)
    clip = chunk_clip(
        [None if p is None else chunk_norms(p) for p in pieces],
        [g.n_chunks for g in layout.groups],
    )
    cpu = out.device.type == "cpu" and out.is_contiguous() and out.dtype == torch.float32
    if cpu and not triton and min_support <= 1:
        _mean_in_cache(out, layout, pieces, clip)
        return
    out.zero_()
    count = torch.zeros(out.shape, dtype=torch.uint8) if min_support > 1 else None
    for piece, factors in zip(pieces, clip.factors, strict=True):
        if piece is not None and factors is not None:
            scatter_add(out, piece, params, factors, triton)
            if count is not None:
                for gi, (g, vals) in enumerate(zip(piece.groups, piece.values(), strict=True)):
                    add_support(count, layout.flat_positions(gi, g.idx).view(-1), vals.view(-1))
    divide_chunks(out, layout, clip.divisors)
    if count is not None:
        keep_supported(out, count, min_support)


def _mean_in_cache(
    out: torch.Tensor, layout: ChunkLayout, pieces: Sequence[SparseTensor | None], clip: ChunkClip
) -> None:
    from codec.native.scatter import mean_group  # numba, imported where it runs

    for piece in pieces:
        if piece is not None and tuple(piece.shape) != tuple(out.shape):
            raise ValueError(f"out must be float32 {piece.shape}, got {tuple(out.shape)}")
    sent = [
        (p, f) for p, f in zip(pieces, clip.factors, strict=True) if p is not None and f is not None
    ]
    for gi in range(len(layout.groups)):
        parts = [
            (p.groups[gi].idx, p.groups[gi].codes, p.groups[gi].scales, p.codebook) for p, _ in sent
        ]
        mean_group(out, layout, gi, parts, [f[gi] for _, f in sent], clip.divisors[gi])
