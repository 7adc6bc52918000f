"""Which peers' updates a window aggregates: a pure function of one chain snapshot.

Every peer and validator computes the same set from the same inputs, so everyone applies the same
aggregate. The rule, for window ``w`` and gather size ``G``:

1. Candidates are the registered uids that have a bucket commitment and no validator permit.
2. Each candidate's *score* is the stake-weighted mean of the weights validators gave it
   (validators without stake count with weight 1 so a fresh subnet still works).
3. ``P = max(1, G // 4)`` probation slots (capped by the candidates without any weight) go to
   unweighted candidates, drawn by a hash of (run id, window, hotkey) so newcomers get in.
4. The remaining ``G - P`` slots (plus probation slots left unused) go to the best scores,
   ties broken by uid.
5. With no weights on chain at all (bootstrap), the first ``G`` candidates by the hash draw.

The result is sorted by uid: the aggregation order (`codec.aggregate` sorts again by key, so the
order never depends on arrival).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from protocol.chain.models import Metagraph


def _draw(run_id: str, window: int, hotkey: str) -> bytes:
    return hashlib.blake2b(f"{run_id}/{window}/{hotkey}".encode(), digest_size=16).digest()


def peer_scores(
    metagraph: Metagraph, weights: Mapping[int, Mapping[int, float]]
) -> dict[int, float]:
    """Stake-weighted mean weight per uid over the validators that set weights."""
    stake = {n.uid: n.stake for n in metagraph.neurons}
    totals: dict[int, float] = {}
    norm = 0.0
    for validator, row in sorted(weights.items()):
        w = stake.get(validator, 0.0) or 1.0
        norm += w
        for uid, value in row.items():
            totals[uid] = totals.get(uid, 0.0) + w * value
    return {uid: v / norm for uid, v in totals.items()} if norm else {}


def select_peers(
    metagraph: Metagraph,
    committed: set[str],
    weights: Mapping[int, Mapping[int, float]],
    run_id: str,
    window: int,
    gather_size: int,
) -> list[int]:
    """The uids whose updates window `window` aggregates (sorted ascending)."""
    candidates = [n for n in metagraph.neurons if n.hotkey in committed and not n.validator_permit]
    by_draw = sorted(candidates, key=lambda n: _draw(run_id, window, n.hotkey))
    scores = peer_scores(metagraph, weights)
    weighted = [n for n in candidates if scores.get(n.uid, 0.0) > 0]
    if not weighted:
        return sorted(n.uid for n in by_draw[:gather_size])
    fresh = [n for n in by_draw if scores.get(n.uid, 0.0) <= 0]
    probation = fresh[: min(len(fresh), max(1, gather_size // 4))]
    best = sorted(weighted, key=lambda n: (-scores[n.uid], n.uid))
    chosen = best[: gather_size - len(probation)] + probation
    return sorted(n.uid for n in chosen)
