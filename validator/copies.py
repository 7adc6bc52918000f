"""Copy and replay detection from the Top-k index sets of decoded updates.

A *sketch* of an update is the sorted array of the global positions it keeps (tensor offset in
spec order + flat position inside the tensor), consistently sub-sampled when the update keeps more
than ``sketch_size`` positions: a position is kept iff ``mix(position, salt) < rate * 2**64``, with
one rate for all tensors and the same salt for every peer, so the sampled Jaccard of two sketches
is an unbiased estimate of the pooled Jaccard of the full index sets (the tiny preset keeps ~20k
positions: its sketches are exact). The salt is random per validator and kept secret, so a copier
cannot learn which positions are sampled and move exactly those.

The overlap of two updates is the *pooled* index-set Jaccard ``sum_t |A_t & B_t| / sum_t |A_t |
B_t|`` over tensors (dominated by the large matrices; the few-entry 1-D tensors would add noise).
Equal payload digests count as overlap 1.

* A copier that jitters the 2-bit values and moves a few indices keeps almost every position:
  moving m of K positions leaves Jaccard ``(K-m)/(K+m)`` (>= 0.8 for m <= K/9).
* Honest peers share a model but train on disjoint data; their Top-k sets overlap far less.
  Measured (`scripts/validator_separation.py`, tiny preset, 3 peers x 4 windows): honest peers of
  one window 0.014-0.129, one peer's update against its own previous one 0.14-0.34, a perturbed
  copy (30 % of values jittered, 10 % of chunks with an index moved) 0.996-0.997. The default
  threshold 0.5 sits with margin on both sides.

Within a window, a pair above ``threshold`` is a copy: the later upload (object LastModified, tie
-> higher uid) is the copier. A decoded update whose sketch matches, by digest or overlap, any
update (its own or another peer's) of the last ``history_windows`` windows is a replay.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial
from typing import Any

import numpy as np
import torch

from codec.chunking import ChunkLayout
from codec.compress import SparseTensor
from codec.spec import CodecParams, ModelSpec

_GOLDEN, _M1, _M2 = (
    np.uint64(0x9E3779B97F4A7C15),
    np.uint64(0xBF58476D1CE4E5B9),
    np.uint64(0x94D049BB133111EB),
)


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = (x ^ np.uint64(salt)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


@dataclass(frozen=True)
class Sketch:
    """What copy detection remembers of one update."""

    uid: int
    window: int
    digest: bytes
    positions: np.ndarray  # sorted unique uint64 global positions (sampled)


def kept_per_update(spec: ModelSpec, params: CodecParams) -> int:
    """How many positions one update keeps (fixed by the spec and the codec parameters)."""
    return sum(ChunkLayout.for_shape(t.shape, params).n_values for t in spec.tensors)


def sketch(
    uid: int,
    window: int,
    digest: bytes,
    update: Sequence[Any],
    spec: ModelSpec,
    params: CodecParams,
    size: int,
    salt: int,
    support: Callable[[Any], torch.Tensor] | None = None,
) -> Sketch:
    """The (sub-sampled) global index set of one decoded update.

    ``support`` maps a piece of the update to its flat positions (`Strategy.support`: a dense
    update's Top-k positions per chunk); by default a sparse piece's kept positions."""
    offsets, off = {}, 0
    for t in spec.tensors:
        offsets[t.name] = off
        off += t.numel
    rate = min(1.0, size / max(1, kept_per_update(spec, params)))
    parts = []
    for piece in update:
        flat = (support or partial(_kept, params=params))(piece)
        parts.append(flat.reshape(-1).numpy().astype(np.uint64) + np.uint64(offsets[piece.name]))
    pos = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.uint64)
    if rate < 1.0:
        pos = pos[_mix(pos, salt) < np.uint64(int(rate * float(2**64 - 1)))]
    return Sketch(uid=uid, window=window, digest=bytes(digest), positions=pos)


def _kept(sparse: SparseTensor, params: CodecParams) -> torch.Tensor:
    layout = sparse.layout(params)
    return torch.cat(
        [layout.flat_positions(gi, g.idx).reshape(-1) for gi, g in enumerate(sparse.groups)]
    )


def overlap(a: Sketch, b: Sketch) -> float:
    """Pooled Jaccard of two sketches (1.0 for equal payload digests)."""
    if a.digest == b.digest:
        return 1.0
    inter = np.intersect1d(a.positions, b.positions, assume_unique=True).size
    union = a.positions.size + b.positions.size - inter
    return inter / union if union else 0.0


@dataclass(frozen=True)
class Match:
    """The strongest overlap a sketch has with another one (and whom it is with)."""

    other_uid: int
    other_window: int
    overlap: float


def best_matches(sketches: Mapping[int, Sketch]) -> dict[int, Match]:
    """For each uid, its highest-overlap partner in the same window."""
    uids = sorted(sketches)
    best: dict[int, Match] = {}
    for i, a in enumerate(uids):
        for b in uids[i + 1 :]:
            o = overlap(sketches[a], sketches[b])
            for x, y in ((a, b), (b, a)):
                if x not in best or o > best[x].overlap:
                    best[x] = Match(y, sketches[y].window, o)
    return best


def find_copies(
    sketches: Mapping[int, Sketch], times: Mapping[int, datetime | None], threshold: float
) -> dict[int, Match]:
    """Copiers -> the earlier upload they copied: for every pair at or above `threshold`, the
    later one (LastModified; tie or unknown time -> higher uid)."""
    uids = sorted(sketches)
    copiers: dict[int, Match] = {}

    def order(uid: int) -> tuple[float, int]:
        t = times.get(uid)
        return (t.timestamp() if t is not None else float("inf"), uid)

    for i, a in enumerate(uids):
        for b in uids[i + 1 :]:
            o = overlap(sketches[a], sketches[b])
            if o < threshold:
                continue
            first, later = sorted((a, b), key=order)
            if later not in copiers or o > copiers[later].overlap:
                copiers[later] = Match(first, sketches[first].window, o)
    return copiers


class SketchHistory:
    """The sketches of the last few windows, for replay detection (bounded)."""

    def __init__(self, windows: int, entries: Iterable[Sketch] = ()) -> None:
        self.windows = windows
        self._by_window: deque[tuple[int, list[Sketch]]] = deque()
        for s in sorted(entries, key=lambda s: s.window):
            self.add(s.window, [s])

    def add(self, window: int, sketches: Iterable[Sketch]) -> None:
        items = list(sketches)
        if self._by_window and self._by_window[-1][0] == window:
            self._by_window[-1][1].extend(items)
        else:
            self._by_window.append((window, items))
        while self._by_window and self._by_window[0][0] <= window - self.windows:
            self._by_window.popleft()

    def entries(self) -> list[Sketch]:
        return [s for _, items in self._by_window for s in items]

    def find_replay(self, s: Sketch, threshold: float) -> Match | None:
        """The best earlier-window match at or above `threshold`, if any."""
        best: Match | None = None
        for old in self.entries():
            if old.window >= s.window or old.window < s.window - self.windows:
                continue
            o = overlap(s, old)
            if o >= threshold and (best is None or o > best.overlap):
                best = Match(old.uid, old.window, o)
        return best
