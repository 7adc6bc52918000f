"""From final scores to an on-chain weight vector.

``weight_i = final_i / sum_j final_j`` over the registered peers (zeros dropped; nothing is set
when every score is zero, which the chain would refuse). The version key is the run's
``codec_version`` (`codec.spec.CODEC_VERSION` unless the run pins another): it changes exactly
when the wire format changes, which is when weights of validators on the old format must stop
counting, and the subnet's ``weights_version_key`` can be raised to it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping

from substrateinterface import Keypair

from protocol.chain.base import Chain
from protocol.chain.errors import ChainError
from protocol.runconfig import RunConfig

log = logging.getLogger(f"tessera.{__name__}")


def normalise(scores: Mapping[int, float], registered: set[int]) -> dict[int, float]:
    """Normalised weights of the registered uids with a positive finite score ({} if none)."""
    kept = {u: s for u, s in scores.items() if u in registered and math.isfinite(s) and s > 0.0}
    total = math.fsum(kept.values())
    return {u: s / total for u, s in sorted(kept.items())} if total > 0 else {}


def version_key(run: RunConfig) -> int:
    return run.codec_version


def set_weights(
    chain: Chain, keypair: Keypair, run: RunConfig, weights: Mapping[int, float]
) -> str:
    """Set `weights` on chain; returns what happened (never raises a chain error)."""
    if not weights:
        return "skipped: no peer has a positive score"
    uids = sorted(weights)
    try:
        chain.set_weights(keypair, uids, [weights[u] for u in uids], version_key(run))
    except ChainError as exc:  # rate limits, permits, races with deregistration: retry later
        log.warning("set_weights failed: %s", exc)
        return f"failed: {type(exc).__name__}: {exc}"
    return f"set {len(uids)} weights"
