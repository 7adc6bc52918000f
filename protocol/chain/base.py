"""The one interface every chain backend implements (embedded local chain, Bittensor subtensor)."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from datetime import datetime
from types import TracebackType
from typing import Self

from substrateinterface import Keypair

from protocol.chain.models import ChainSnapshot, Commitment, Metagraph


class Chain(abc.ABC):
    """A subnet on a chain: time (blocks), membership (metagraph), commitments and weights.

    Reads return validated models; writes take the hotkey's `Keypair` and raise the typed errors
    of `protocol.chain.errors`. A `Chain` is bound to one subnet (`netuid`).
    """

    @property
    @abc.abstractmethod
    def netuid(self) -> int:
        """The subnet this handle reads and writes."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The URL this chain was opened from (never carries secrets)."""

    # -- time ------------------------------------------------------------------------------------

    @abc.abstractmethod
    def block(self) -> int:
        """The current block number."""

    @abc.abstractmethod
    def block_timestamp(self, block: int) -> datetime:
        """The UTC time of `block` (`ChainError` for a block that does not exist yet)."""

    # -- membership ------------------------------------------------------------------------------

    @abc.abstractmethod
    def metagraph(self) -> Metagraph:
        """All neurons of the subnet, read at one block."""

    @abc.abstractmethod
    def uid_of(self, hotkey: str) -> int | None:
        """The uid of `hotkey` on the subnet, or None if it is not registered."""

    # -- commitments -----------------------------------------------------------------------------

    @abc.abstractmethod
    def commit(self, keypair: Keypair, data: bytes) -> Commitment:
        """Publish `data` (at most 128 bytes, one raw field) as the hotkey's commitment.

        Raises `NotRegistered`, `CommitmentTooLarge`, `RateLimited` or `PermissionDenied`.
        Returns the commitment as recorded, with the block it landed in.
        """

    @abc.abstractmethod
    def read_commitment(self, hotkey: str) -> Commitment | None:
        """The hotkey's latest commitment, or None (also None when the stored value is malformed)."""

    @abc.abstractmethod
    def read_all_commitments(self) -> dict[str, Commitment]:
        """Every well-formed commitment on the subnet, by hotkey (malformed entries are skipped)."""

    # -- weights ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def set_weights(
        self,
        keypair: Keypair,
        uids: Sequence[int],
        weights: Sequence[float],
        version_key: int,
    ) -> None:
        """Set the validator's weights; they are normalised, zero entries dropped.

        Raises `InvalidWeights`, `NotRegistered`, `PermissionDenied` or `RateLimited`.
        """

    @abc.abstractmethod
    def read_weights(self, validator: int | str) -> dict[int, float]:
        """The weights set by a validator (uid or hotkey), normalised to sum 1; `{}` if none."""

    @abc.abstractmethod
    def weights_all(self) -> dict[int, dict[int, float]]:
        """Every validator's normalised weights, keyed by validator uid (empty rows left out)."""

    # -- one block, pinned -----------------------------------------------------------------------

    @abc.abstractmethod
    def snapshot(self, block: int) -> ChainSnapshot:
        """The subnet exactly as it was after every write of blocks <= `block`.

        Metagraph (with each neuron's `registered_block` and `last_update`), the well-formed
        commitments by hotkey (as `read_all_commitments`) and the validators' normalised weights
        (as `weights_all`), all read at that one block: every caller asking for the same block
        gets an equal snapshot, whenever and wherever it asks, whatever is written meanwhile.

        Raises `BlockNotFinal` when `block` is not final yet (its contents could still change:
        above subtensor's finalized head; on the local chain, less than 2 blocks behind the head),
        `BlockPruned` when the node no longer keeps that block's state (non-archive subtensor
        nodes keep about the last 256 blocks), `ChainError` for a block before the subnet existed.
        """

    # -- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:  # noqa: B027 - optional hook, most backends have something to close
        """Release connections. The handle must not be used afterwards."""

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
