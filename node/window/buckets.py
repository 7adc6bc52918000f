"""From on-chain commitments to readable stores: how a node reaches every other node's bucket."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from protocol.chain.base import Chain
from protocol.chain.models import Commitment, Metagraph
from protocol.commitment import BucketCommitment, CommitmentError, Provider, parse_commitment
from protocol.endpoints import ALLOW_PRIVATE_ENV, EndpointPolicy
from protocol.stores import ReadableStore, StoreError, open_store


@dataclass(frozen=True)
class PeerBucket:
    """A registered peer and the read-only store its commitment points at."""

    uid: int
    hotkey: str
    store: ReadableStore
    keeps_clock: bool = False  # `Provider.keeps_clock`: its Last-Modified can be trusted


def store_for(
    commitment: BucketCommitment, local_root: Path | None, policy: EndpointPolicy
) -> ReadableStore:
    """Open the bucket a commitment names with its read key (never with our write key); every
    connection to it obeys `policy` (`protocol.endpoints`)."""
    if commitment.provider is Provider.LOCAL:
        if local_root is None:
            raise CommitmentError("a local bucket needs the simulation's storage root")
        return open_store(f"file://{local_root}?bucket={commitment.bucket}", commitment.credentials)
    url = f"s3://{commitment.bucket}?endpoint={commitment.endpoint_url}&region={commitment.region_name}"
    return open_store(url, commitment.credentials, endpoint_policy=policy)


def peer_buckets(
    chain: Chain, local_root: Path | None = None, allow_private: bool = False
) -> tuple[dict[int, PeerBucket], dict[int, str]]:
    """`buckets_from` the chain head (for lookups outside a window's pinned roster)."""
    return buckets_from(chain.metagraph(), chain.read_all_commitments(), local_root, allow_private)


def buckets_from(
    metagraph: Metagraph,
    commitments: Mapping[str, Commitment],
    local_root: Path | None = None,
    allow_private: bool = False,
) -> tuple[dict[int, PeerBucket], dict[int, str]]:
    """Every registered uid with a usable commitment; and why the others have none.

    Private and plain-http endpoints (MinIO on a LAN, a local simulation) are accepted only with
    `allow_private`, a local storage root, or `TESSERA_ALLOW_PRIVATE_ENDPOINTS=1`.
    """
    allow_private = allow_private or local_root is not None
    allow_private = allow_private or os.environ.get(ALLOW_PRIVATE_ENV) == "1"
    policy = EndpointPolicy.of(allow_private)
    found: dict[int, PeerBucket] = {}
    problems: dict[int, str] = {}
    for neuron in metagraph.neurons:
        c = commitments.get(neuron.hotkey)
        if c is None:
            problems[neuron.uid] = "no commitment"
            continue
        try:
            parsed = parse_commitment(c.data, allow_private_endpoints=allow_private)
            store = store_for(parsed, local_root, policy)
            found[neuron.uid] = PeerBucket(
                neuron.uid, neuron.hotkey, store, parsed.provider.keeps_clock
            )
        except (CommitmentError, StoreError, ValueError) as exc:
            problems[neuron.uid] = f"bad commitment: {exc}"
    return found, problems
