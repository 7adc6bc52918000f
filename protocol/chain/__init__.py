"""Chains: the embedded local chain (SQLite) and Bittensor subtensor, behind one `Chain` interface.

from protocol.chain import open_chain
chain = open_chain("local:///tmp/sim/chain.db", netuid=1)   # or "wss://entrypoint-finney..."
"""

from protocol.chain.base import Chain
from protocol.chain.errors import (
    BlockNotFinal,
    BlockPruned,
    ChainError,
    ChainUnavailable,
    CommitmentTooLarge,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
)
from protocol.chain.models import (
    MAX_COMMITMENT_BYTES,
    ChainSnapshot,
    Commitment,
    Metagraph,
    Neuron,
)
from protocol.chain.url import open_chain

__all__ = [
    "MAX_COMMITMENT_BYTES",
    "BlockNotFinal",
    "BlockPruned",
    "Chain",
    "ChainError",
    "ChainSnapshot",
    "ChainUnavailable",
    "Commitment",
    "CommitmentTooLarge",
    "InvalidWeights",
    "Metagraph",
    "Neuron",
    "NotRegistered",
    "PermissionDenied",
    "RateLimited",
    "open_chain",
]
