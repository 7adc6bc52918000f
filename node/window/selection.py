"""Which peers' updates a window aggregates: a pure function of one pinned chain snapshot.

Every peer and validator computes the same set from the same snapshot (`node.window.consensus`),
so everyone applies the same aggregate. The rule, for window ``w`` and gather size ``G``:

1. Candidates are the registered uids that have a bucket commitment and no validator permit.
2. Each candidate's *score* is the stake-weighted mean of the weights validators gave it
   (validators without stake count with weight 1 so a fresh subnet still works).
3. A candidate is **never scored** when it registered after the last weight update of every
   validator in the snapshot. Only those can take a probation slot: a uid that validators have
   already weighed and given nothing (zeroed, penalised) never gets one. Probation holds at most
   ``floor(G * probation_fraction)`` slots (at least one when the fraction is positive), drawn by
   a hash of (run id, window, hotkey).
4. The remaining slots go to the best positive scores, ties broken by uid.
5. Slots still free (fewer positive scores than slots) go to the other candidates, zero scores
   included, in the order of a hash of (run id, window, hotkey): a window whose weights came
   from a validator that could score only a few peers never shrinks the next windows' sets to
   those few. Such an update is applied only with evidence of training on its own samples
   (`validator.admission`), so a zeroed crowd gains slots nobody else wanted and nothing more.
6. With no weights on chain at all (bootstrap), the first ``G`` candidates by the hash draw.

Influence: the outer step scales each update to at most the lower median norm ``B`` of the
window's updates and divides by ``N' > N / 2`` (`node.strategy.aggregator`), so the ``P`` probation
updates move the model by at most ``α · P · B / N'`` in L2 norm, ``N`` the number of updates
applied.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping

from protocol.chain.models import Metagraph, Neuron
from protocol.runconfig import RunConfig


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


def never_scored(neuron: Neuron, metagraph: Metagraph) -> bool:
    """True when no validator of the snapshot has updated its weights since `neuron` registered."""
    return all(v.last_update < neuron.registered_block for v in metagraph.validators)


def probation_slots(run: RunConfig) -> int:
    """The most never-scored uids a window may aggregate."""
    fraction = run.consensus.probation_fraction
    if fraction <= 0:
        return 0
    return max(1, math.floor(run.gather_size * fraction))


def select_peers(
    metagraph: Metagraph,
    committed: set[str],
    weights: Mapping[int, Mapping[int, float]],
    run: RunConfig,
    window: int,
) -> list[int]:
    """The uids whose updates window `window` aggregates (sorted ascending)."""
    gather_size = run.gather_size
    candidates = [n for n in metagraph.neurons if n.hotkey in committed and not n.validator_permit]
    by_draw = sorted(candidates, key=lambda n: _draw(run.run_id, window, n.hotkey))
    if not any(weights.values()):  # bootstrap: nobody has been weighed yet
        return sorted(n.uid for n in by_draw[:gather_size])
    scores = peer_scores(metagraph, weights)
    fresh = [n for n in by_draw if never_scored(n, metagraph) and scores.get(n.uid, 0.0) <= 0]
    probation = fresh[: min(probation_slots(run), gather_size)]
    weighted = [n for n in candidates if scores.get(n.uid, 0.0) > 0]
    best = sorted(weighted, key=lambda n: (-scores[n.uid], n.uid))
    chosen = best[: gather_size - len(probation)] + probation
    taken = {n.uid for n in chosen}
    free = [n for n in by_draw if n.uid not in taken][: gather_size - len(chosen)]
    return sorted(n.uid for n in chosen + free)
