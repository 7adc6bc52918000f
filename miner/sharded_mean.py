"""The window's mean on FSDP2 ranks: each rank builds only its own rows of it.

Every rule of the mean is chunk-local and every entry is summed elementwise (`codec.bands`), so
a rank's rows of the mean are the rows of the mean of its *band* (the whole chunks that hold its
rows), computed from the window's updates cut to that band. Rank 0 decodes each agreed update
once, checks it, and sends every rank the chunks of its band (sparse entries, about 1/N of the
update each); each rank then sums its band on its host and keeps its rows. No rank holds a whole
tensor of the mean, nor the whole mean's memory: a rank's band is its rows and at most a tile of
rows (a chunk of a vector) on each side. A vector of one chunk is one band, whole on every rank.

The bits are the whole mean's (`tests/unit/test_bands.py`, and the two-rank test in
`tests/e2e/test_fsdp.py`), so a sharded peer steps exactly as a single process does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from codec.bands import Band, band_of, cut
from codec.spec import ModelSpec, TensorSpec
from miner.ranks import Ranks
from node.strategy import make_strategy
from node.strategy.aggregator import Aggregator
from node.window.gather import Pieces
from protocol.runconfig import RunConfig

__all__ = ["banded_mean", "shard_rows"]


def shard_rows(rows: int, world: int, rank: int) -> tuple[int, int]:
    """Rank `rank`'s rows ``[lo, hi)`` of a first dimension of `rows` as FSDP2 shards it
    (``torch.chunk``: ``ceil(rows / world)`` each, the last ones shorter or empty)."""
    size = -(-rows // world)
    lo = min(rank * size, rows)
    return lo, min(lo + size, rows)


def banded_mean(
    agreed: Mapping[int, Any] | None,
    ranks: Ranks,
    run: RunConfig,
    spec: ModelSpec,
    checker: Aggregator,
) -> dict[str, torch.Tensor]:
    """This rank's rows of the mean of rank 0's `agreed` updates (None on the other ranks), on
    the CPU, in spec order (a collective: every rank calls it). `checker` validates each update
    on rank 0 before it is cut."""
    shapes = {t.name: tuple(t.shape) for t in spec.tensors}
    rows = [
        {n: shard_rows(s[0], ranks.world, r) for n, s in shapes.items()} for r in range(ranks.world)
    ]
    bands = [
        {n: band_of(shapes[n], run.codec, *rows[r][n]) for n in shapes} for r in range(ranks.world)
    ]
    uids = ranks.broadcast_object(sorted(agreed) if agreed is not None else None)
    pieces = Pieces(agreed) if agreed is not None else None
    mine: dict[int, list[Any]] = {}
    for uid in uids:
        parts = None
        if pieces is not None:
            update = checker.checked(pieces[uid])
            parts = [_cut_update(update, bands[r], run) for r in range(ranks.world)]
        mine[uid] = ranks.scatter_object(parts)
    own = bands[ranks.rank]
    band_spec = ModelSpec(
        tensors=tuple(TensorSpec(name=n, shape=own[n].shape(shapes[n])) for n in shapes)
    )
    means = make_strategy(run, band_spec).aggregator.mean(mine)
    out = {}
    for name in shapes:
        lo, hi = rows[ranks.rank][name]
        start = own[name].start
        out[name] = means.pop(name)[lo - start : hi - start].clone()
    return out


def _cut_update(update: Mapping[str, Any], bands: Mapping[str, Band], run: RunConfig) -> list[Any]:
    return [cut(piece, bands[name], run.codec) for name, piece in update.items()]
