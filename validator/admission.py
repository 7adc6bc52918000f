"""Which of the window's selected updates the lead applies: those that show training.

**The attack.** Registration is all a hotkey needs to be selected: before any weights exist the
selection is a hash draw (`node.window.selection`), so a crowd registered at launch holds most of
the slots, and later a few hotkeys hold the probation slots. A crowd of null, random or tiny
updates in the applied set then (a) sets the outer step's clip bound, the lower median norm,
which shrinks every honest update to the crowd's size when the crowd is a majority (training
stops), and (b) adds random directions to the mean until weights shut it out (a loss bump).

**The defence.** The lead scores the selected updates that passed every check before it decides
(`validator.scoring`: each update probed at its own norm, so what one update shows depends on it
alone), and applies those whose own-data statistic reaches ``admit_z`` (1.5) this window and
whose own-data effect is at least ``admit_min_effect`` (1e-5 of the loss: an update too small to
move the loss beyond float rounding shows rounding patterns, not training; an honest one's
effect is about 3e-3 at launch, a 1e-9 random one's 1e-8, measured in `tessera sim`). A null
update (nothing trained on the peer's own samples: random, tiny, all-zero, copied) has
``z ~ N(0, 1)``, so it gets in with probability 0.067; an honest one has a mean ``z`` of about
2.4 without a covariate (the first window, beside a crowd), 5.8 beside a crowd and 9.0 without
one with the previous window's step as a covariate (the next windows, until two peers earn), and
4.4 with the earning peers' consensus (`validator.scoring`).
An update the lead had no time to score is applied only
when its peer's own-data evidence already earns (`validator.ratings.Book.earning`). Last,
updates whose norm exceeds ``norm_ratio`` times the lower median of the admitted ones are norm
outliers (`validator.checks.norm_outliers`). Followers and peers apply the lead's manifest, so
nothing here has to be computed alike by every node.

**What it does not stop.** A crowd that trains on its own samples and scales its updates down
shows evidence and gets in; as a majority of the applied set it shrinks the step. It pays for
that with the training of every hotkey, each of which earns like an honest peer would.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from node.window.consensus import MIN_PUBLISH_RESERVE_S
from validator.checks import norm_outliers
from validator.scoring import LossScore, pick_scored


def probe_order(
    run_id: str, window: int, uids: Sequence[int], established: Collection[int]
) -> list[int]:
    """The order in which the lead probes `uids`: the peers without earning evidence first (they
    need it to be applied at all), each group in the window's drawn order
    (`validator.scoring.pick_scored`), so that no uid is always the one left unprobed."""
    return sorted(pick_scored(run_id, window, uids, 0), key=lambda u: u in established)


@dataclass(frozen=True)
class Admission:
    """The lead's decision on the selected updates that passed every check."""

    admitted: frozenset[int]
    refused: dict[int, str] = field(default_factory=dict)  # uid -> why, for the manifest
    scored: int = 0
    seconds: float = 0.0


def admit(
    order: Sequence[int],
    score: Callable[[int], LossScore | None],
    norms: Mapping[int, float],
    established: Collection[int],
    until: float,
    admit_z: float,
    min_effect: float,
    norm_ratio: float,
    first_estimate_s: float = 0.0,
) -> Admission:
    """Score the candidates in `order` (selected, every check passed) while the longest score
    so far (before the first: `first_estimate_s`) still fits before `until` (monotonic
    seconds), admit those with ``own_z >= admit_z``
    and an own-data effect of at least `min_effect`, and those left unscored whose peer is
    `established`; then refuse the norm outliers of the admitted set."""
    admitted, refused = set(), {}
    start, longest, scored = time.monotonic(), first_estimate_s, 0
    for uid in order:
        begun = time.monotonic()
        s = score(uid) if begun + longest <= until else None
        if s is not None:
            scored += 1
            longest = max(longest if scored > 1 else 0.0, time.monotonic() - begun)
        if s is None:
            if uid in established:
                admitted.add(uid)
            else:
                refused[uid] = "not scored in time, no own-data evidence yet"
        elif not s.own.diff >= min_effect:
            refused[uid] = f"no own-data effect: {s.own.diff:.2g} < {min_effect:g}"
        elif math.isfinite(s.own.z) and s.own.z >= admit_z:
            admitted.add(uid)
        else:
            refused[uid] = f"no own-data evidence: z {s.own.z:.2f} < {admit_z:g}"
    kept = {u: norms[u] for u in admitted}
    for uid, detail in norm_outliers(kept, list(kept.values()), norm_ratio).items():
        admitted.discard(uid)
        refused[uid] = detail
    return Admission(frozenset(admitted), refused, scored, time.monotonic() - start)


def publish_reserve(
    left: float, last_publish_s: float | None, publish_bytes: int, fetched_bytes: int,
    fetch_s: float, write_rate: float | None = None,
) -> float:  # fmt: skip
    """Seconds the lead keeps, of the `left` before its last block to publish, for publishing
    its decision after the admission probes: twice what publishing took last time, at least
    `MIN_PUBLISH_RESERVE_S`. Before it ever published: twice the time `publish_bytes` (the
    applied updates' bodies, which the aggregate puts once) take at the `write_rate` measured on
    our own bucket (`node.runtime.preflight.write_rate`), else at the rate this window's fetch
    reached, at least that floor, never more than half the time left. The fetch rate counts the
    time spent waiting for slow peers and decoding too, so it understates the link and the
    reserve errs long (at launch, a reserve of half the time left cost honest updates their
    probe); a crowd of slow uploads can push it only up to that half."""
    if last_publish_s is not None:
        return min(left, max(MIN_PUBLISH_RESERVE_S, 2.0 * last_publish_s))
    half = 0.5 * left
    if write_rate is not None and write_rate > 0:
        transfer = publish_bytes / write_rate
    elif fetched_bytes > 0 and fetch_s > 0:
        transfer = publish_bytes * fetch_s / fetched_bytes
    else:
        return half
    return min(half, max(MIN_PUBLISH_RESERVE_S, 2.0 * transfer))
