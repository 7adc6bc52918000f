"""Typed errors for every chain backend.

Callers catch `ChainError` for "the chain said no or could not be reached" and the subclasses when
they can act on the reason (register, back off, retry later, shrink the commitment).
"""

from __future__ import annotations

from codec.errors import TesseraError


class ChainError(TesseraError):
    """Base class for everything a chain backend raises on purpose."""


class NotRegistered(ChainError):
    """The hotkey holds no uid on the subnet; the message says how to register it."""

    def __init__(self, hotkey: str, netuid: int, how_to_register: str) -> None:
        self.hotkey = hotkey
        self.netuid = netuid
        super().__init__(f"hotkey {hotkey} is not registered on subnet {netuid}; {how_to_register}")


class ChainUnavailable(ChainError):
    """The chain could not be reached or did not answer (network, node down, locked database)."""


class CommitmentTooLarge(ChainError, ValueError):
    """The commitment exceeds the on-chain limit of one raw field."""


class RateLimited(ChainError):
    """The chain refuses the call for now; retry after `retry_after_blocks` blocks if known."""

    def __init__(self, message: str, retry_after_blocks: int | None = None) -> None:
        self.retry_after_blocks = retry_after_blocks
        super().__init__(message)


class PermissionDenied(ChainError):
    """The caller cannot prove it holds the hotkey, or the hotkey lacks a needed permit."""


class InvalidWeights(ChainError, ValueError):
    """Weights that no chain would accept: unknown or duplicate uids, NaN, negative, all zero."""


class BlockNotFinal(ChainError):
    """The block is not final yet: what it holds could still change, so it cannot be snapshotted.

    `latest_final` is the newest block that can be read now; retry once `block <= latest_final`.
    """

    def __init__(self, message: str, *, block: int, latest_final: int) -> None:
        self.block = block
        self.latest_final = latest_final
        super().__init__(message)


class BlockPruned(ChainError):
    """The node no longer keeps the state of that block (a non-archive node); use an archive node."""
