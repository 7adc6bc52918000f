"""From on-chain commitments to readable stores: how a node reaches every other node's bucket."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from node.window.selection import select_peers
from protocol.chain.base import Chain
from protocol.chain.models import Metagraph
from protocol.commitment import BucketCommitment, CommitmentError, Provider, parse_commitment
from protocol.runconfig import RunConfig
from protocol.stores import ReadableStore, StoreError, open_store

ALLOW_PRIVATE_ENV = "TESSERA_ALLOW_PRIVATE_ENDPOINTS"  # see docker/.env.example


@dataclass(frozen=True)
class PeerBucket:
    """A registered peer and the read-only store its commitment points at."""

    uid: int
    hotkey: str
    store: ReadableStore


def store_for(commitment: BucketCommitment, local_root: Path | None) -> ReadableStore:
    """Open the bucket a commitment names with its read key (never with our write key)."""
    if commitment.provider is Provider.LOCAL:
        if local_root is None:
            raise CommitmentError("a local bucket needs the simulation's storage root")
        return open_store(f"file://{local_root}?bucket={commitment.bucket}", commitment.credentials)
    url = f"s3://{commitment.bucket}?endpoint={commitment.endpoint_url}&region={commitment.region_name}"
    return open_store(url, commitment.credentials)


def peer_buckets(
    chain: Chain,
    local_root: Path | None = None,
    allow_private: bool = False,
    metagraph: Metagraph | None = None,
) -> tuple[dict[int, PeerBucket], dict[int, str]]:
    """Every registered uid with a usable commitment; and why the others have none.

    Private and plain-http endpoints (MinIO on a LAN, a local simulation) are accepted only with
    `allow_private`, a local storage root, or `TESSERA_ALLOW_PRIVATE_ENDPOINTS=1`.
    """
    allow_private = allow_private or os.environ.get(ALLOW_PRIVATE_ENV) == "1"
    metagraph = metagraph or chain.metagraph()
    commitments = chain.read_all_commitments()
    found: dict[int, PeerBucket] = {}
    problems: dict[int, str] = {}
    for neuron in metagraph.neurons:
        c = commitments.get(neuron.hotkey)
        if c is None:
            problems[neuron.uid] = "no commitment"
            continue
        try:
            parsed = parse_commitment(
                c.data, allow_private_endpoints=allow_private or local_root is not None
            )
            found[neuron.uid] = PeerBucket(neuron.uid, neuron.hotkey, store_for(parsed, local_root))
        except (CommitmentError, StoreError, ValueError) as exc:
            problems[neuron.uid] = f"bad commitment: {exc}"
    return found, problems


@dataclass(frozen=True)
class Roster:
    """One chain snapshot of a window: who is registered, whose bucket we can read (and why
    not), and which uids the window aggregates (`node.window.selection.select_peers`)."""

    metagraph: Metagraph
    buckets: dict[int, PeerBucket]
    problems: dict[int, str]
    selected: list[int]


def window_roster(chain: Chain, run: RunConfig, window: int, local_root: Path | None) -> Roster:
    """The roster every peer and validator computes alike for `window`."""
    metagraph = chain.metagraph()
    buckets, problems = peer_buckets(chain, local_root, metagraph=metagraph)
    selected = select_peers(
        metagraph,
        {b.hotkey for b in buckets.values()},
        chain.weights_all(),
        run.run_id,
        window,
        run.gather_size,
    )
    return Roster(metagraph, buckets, problems, selected)
