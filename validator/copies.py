"""Copy, mix, replay and recycling detection on decoded updates: index sets *and* values.

A *sketch* of an update is the sorted array of the global positions it keeps (tensor offset in
spec order + flat position inside the tensor) with the dequantized value at each, consistently
sub-sampled when the update keeps more than ``sketch_size`` positions: a position is kept iff
``mix(position, salt) < rate * 2**64``, with one rate for all tensors and the same salt for every
peer, so two sketches sample the same global positions (the tiny preset keeps ~20k positions: its
sketches are exact). The salt is random per validator and kept secret, so a copier cannot learn
which positions are sampled and alter exactly those.

**The attack.** A derivative update is built from updates the attacker did not compute: a copy,
a copy with its values re-quantised or jittered, a chunk-by-chunk (or entry-by-entry) mix of two
or more peers, the Top-k of a sum of peers, the window's published aggregate re-compressed
(*recycled*), or a peer's own or another's update of an earlier window (*replay*). Index overlap
alone misses most of these: a 50/50 chunk mix overlaps each source by a Jaccard of ~0.33, the Top-k
of a sum by ~0.3, a recycled aggregate by ~0.3 (all measured on the tiny preset).

**The statistic: explained share.** For a suspect ``x`` (its sampled values) and a candidate
source ``a``, ``a|x`` is ``a`` restricted to the positions ``x`` keeps (0 elsewhere). The
explained share of ``x`` by sources ``a_1..a_m`` is the R² of the least-squares fit
``x ≈ Σ c_j a_j|x``. Every derivative above is, position by position, a combination of its
sources' values at the positions it keeps: a chunk mix is ``A|x + B|x`` exactly (share ≈ 1 at any
mixing ratio or granularity), the Top-k of ``A + B`` is ``A|x + B|x`` up to quantisation, a
re-quantised or scaled copy is ``c·A|x``. An honest update shares with another peer only the
positions both selected (the large, common gradient entries), and its values there agree only as
far as the two peers' gradients do. The sources are chosen greedily (each one the candidate that
explains most of what is left), from the *eligible* candidates:

* the other updates of the window that were provably uploaded earlier (`Stamp`, `may_copy`):
  a source's time counts only when its bucket's provider keeps the clock (`Stamp.trusted`), and
  an uploader whose clock is not trusted is never the earlier one — so a copier on a self-hosted
  server cannot claim to be first. Between two untrusted clocks the order is unknown and each may
  explain the other (documented in docs/incentives.md: honest peers never explain each other);
* every update of the last ``history_windows`` windows, the suspect's own included (replays);
* the aggregate each of those windows applied (`aggregate_sketch`: recycling).

Two shares are kept per update (`Explained`): by the window's eligible uploads, combined, and
by the single closest update or aggregate of the last windows. An honest update is not far from
*history* in direction — training moves the same coordinates the same way window after window,
so several earlier updates together explain about half of it (measured) — but no single earlier
object explains it the way a replay or a recycled aggregate is explained (≥ 0.95). So: a share of
at least ``copy_threshold`` by the window's uploads is a ``copy``; otherwise a single-source
share of at least ``replay_threshold`` by history is a ``replay``. The separation (honest shares
against derivatives) is measured by `scripts/experiments/validator_separation.py` and stated in docs/results.md.
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
from codec.spec import CodecParams, ModelSpec
from node.strategy.sparseloco import sparse_entries

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


AGGREGATE_UID = -1
"""The uid under which a window's applied aggregate is kept in the history."""
MAX_SOURCES = 4
"""Most sources one explanation may combine."""
_SHORTLIST = 12
"""Candidates (best alone) that the greedy fit considers."""


@dataclass(frozen=True)
class Sketch:
    """What copy detection remembers of one update (or of one window's aggregate)."""

    uid: int
    window: int
    digest: bytes
    positions: np.ndarray  # sorted unique uint64 global positions (sampled)
    values: np.ndarray  # float32 dequantized value at each position


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
    entries: Callable[[Any], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Sketch:
    """The (sub-sampled) global positions and values of one decoded update. ``entries`` maps a
    piece of it to (flat positions, values) (`UpdateFormat.entries`); by default a sparse
    piece's."""
    offsets, off = {}, 0
    for t in spec.tensors:
        offsets[t.name] = off
        off += t.numel
    rate = min(1.0, size / max(1, kept_per_update(spec, params)))
    pos_parts, val_parts = [], []
    for piece in update:
        flat, vals = (entries or partial(sparse_entries, params=params))(piece)
        pos_parts.append(
            flat.reshape(-1).numpy().astype(np.uint64) + np.uint64(offsets[piece.name])
        )
        val_parts.append(vals.reshape(-1).float().numpy())
    pos = np.concatenate(pos_parts) if pos_parts else np.zeros(0, np.uint64)
    val = np.concatenate(val_parts) if val_parts else np.zeros(0, np.float32)
    if rate < 1.0:
        keep = _mix(pos, salt) < np.uint64(int(rate * float(2**64 - 1)))
        pos, val = pos[keep], val[keep]
    order = np.argsort(pos, kind="stable")
    return Sketch(uid, window, bytes(digest), pos[order], val[order].astype(np.float32))


def aggregate_sketch(window: int, members: Sequence[Sketch], factors: Sequence[float]) -> Sketch:
    """The sketch of ``Σ factors[i] · members[i]`` (a window's applied mean: the factors are the
    clip factors over the number of updates); sampling is consistent, so this is exact."""
    if not members:
        return Sketch(AGGREGATE_UID, window, b"", np.zeros(0, np.uint64), np.zeros(0, np.float32))
    pos = np.concatenate([m.positions for m in members])
    val = np.concatenate(
        [m.values.astype(np.float64) * f for m, f in zip(members, factors, strict=True)]
    )
    uniq, inverse = np.unique(pos, return_inverse=True)
    summed = np.bincount(inverse, weights=val, minlength=uniq.size)
    return Sketch(AGGREGATE_UID, window, b"", uniq, summed.astype(np.float32))


def overlap(a: Sketch, b: Sketch) -> float:
    """Pooled index Jaccard of two sketches (1.0 for equal payload digests): information only."""
    if a.digest and a.digest == b.digest:
        return 1.0
    inter = np.intersect1d(a.positions, b.positions, assume_unique=True).size
    union = a.positions.size + b.positions.size - inter
    return inter / union if union else 0.0


@dataclass(frozen=True)
class Match:
    """The strongest index overlap a sketch has with another one (and whom it is with)."""

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


# -- explained share -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Derivation:
    """How much of an update its best sources explain, and which ones (uid, window)."""

    share: float
    sources: tuple[tuple[int, int], ...]

    def detail(self) -> str:
        names = ", ".join(
            f"the aggregate of window {w}" if u == AGGREGATE_UID else f"uid {u} (window {w})"
            for u, w in self.sources
        )
        return f"{self.share:.3f} of its energy is explained by {names}"


def _masked(x: Sketch, source: Sketch) -> np.ndarray:
    """``source|x``: the source's values at the positions `x` keeps (float64, 0 elsewhere)."""
    out = np.zeros(x.positions.size, np.float64)
    _, ix, isrc = np.intersect1d(x.positions, source.positions, True, return_indices=True)
    out[ix] = source.values[isrc]
    return out


def explain(x: Sketch, pool: Sequence[Sketch], max_sources: int = MAX_SOURCES) -> Derivation:
    """The explained share of `x` by at most `max_sources` sources from `pool` (greedy:
    orthogonal matching pursuit over the `_SHORTLIST` candidates that explain most alone)."""
    target = x.values.astype(np.float64)
    energy = float(target @ target)
    if energy <= 0 or not np.isfinite(energy):
        return Derivation(0.0, ())
    for s in pool:
        if x.digest and s.digest == x.digest:
            return Derivation(1.0, ((s.uid, s.window),))
    cols, alone = [], []
    for s in pool:
        a = _masked(x, s)
        na = float(a @ a)
        if na > 0:
            cols.append((s, a))
            alone.append(float(target @ a) ** 2 / (na * energy))
    short = [cols[i] for i in np.argsort(alone)[::-1][:_SHORTLIST]]
    residual, chosen = target.copy(), []
    basis: list[np.ndarray] = []
    for _ in range(min(max_sources, len(short))):
        best, best_gain, best_dir = None, 0.0, None
        for j, (_, a) in enumerate(short):
            if j in chosen:
                continue
            d = a.copy()
            for q in basis:  # orthogonal to what is already chosen
                d -= (q @ d) * q
            nd = float(np.sqrt(d @ d))
            if nd <= 1e-12 * np.sqrt(float(a @ a)):
                continue
            d /= nd
            gain = float(residual @ d) ** 2
            if gain > best_gain:
                best, best_gain, best_dir = j, gain, d
        if best is None or best_dir is None or best_gain <= 1e-6 * energy:
            break
        chosen.append(best)
        basis.append(best_dir)
        residual -= (residual @ best_dir) * best_dir
    share = 1.0 - float(residual @ residual) / energy
    return Derivation(max(0.0, share), tuple((short[j][0].uid, short[j][0].window) for j in chosen))


@dataclass(frozen=True)
class Stamp:
    """When an update was stored, and whether that time comes from a clock its uploader does not
    control (the provider's own: `protocol.commitment.Provider.keeps_clock`)."""

    time: datetime | None
    trusted: bool


def may_copy(source: int, suspect: int, stamps: Mapping[int, Stamp]) -> bool:
    """Whether `source`'s update of this window can have been copied by `suspect`: the source's
    trusted time is strictly earlier, or the suspect's clock is not trusted, or neither clock is
    (the order is unknown). Object times have a resolution of one second: two updates stamped in
    the same second are in no known order, and neither is the other's copy by time (a uid order
    would let a copier with a lower uid that lands in its victim's second make the victim the
    copier)."""
    s, x = stamps.get(source), stamps.get(suspect)
    s_ok = s is not None and s.trusted and s.time is not None
    x_ok = x is not None and x.trusted and x.time is not None
    if not s_ok:
        return not x_ok
    if not x_ok:
        return True
    return s.time < x.time  # type: ignore[union-attr,operator]


@dataclass(frozen=True)
class Explained:
    """What explains one update: the window's earlier uploads (up to `MAX_SOURCES` combined),
    and the single closest update or aggregate of an earlier window."""

    window: Derivation
    history: Derivation


def explain_window(
    sketches: Mapping[int, Sketch],
    stamps: Mapping[int, Stamp],
    history: SketchHistory,
    replay_threshold: float,
) -> dict[int, Explained]:
    """Every update's `Explained`: by this window's updates that `may_copy` allows, and by
    `history`'s entries from earlier windows one at a time.

    Two sources never count against an update:

    * its own uid's earlier updates: error feedback carries a peer's unsent mass from window to
      window, so late in a run its honest updates are largely its previous ones (the main job
      measured shares of 0.85–0.94 from window 7 on, `docs/incentives.md`);
    * this window's uploads that are themselves replays (history share at or above
      `replay_threshold`): a stale copy of a peer's previous update, uploaded early, would
      otherwise explain that peer's fresh update and make the honest peer the copier.
    """
    earlier = history.entries()
    past = {
        uid: explain(x, [s for s in earlier if s.window < x.window and s.uid != uid], max_sources=1)
        for uid, x in sketches.items()
    }
    replays = {u for u, d in past.items() if d.share >= replay_threshold}
    out = {}
    for uid, x in sorted(sketches.items()):
        pool = [
            s
            for u, s in sketches.items()
            if u != uid and u not in replays and may_copy(u, uid, stamps)
        ]
        out[uid] = Explained(explain(x, pool), past[uid])
    return out


class SketchHistory:
    """The sketches (updates and applied aggregates) of the last few windows (bounded)."""

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
