"""Typed errors for object stores.

Every failure a store can raise derives from `StoreError`, so a caller that only wants "did the
fetch work" catches one class, while a validator that scores peers can tell "the peer never
uploaded" (`ObjectNotFound`) from "the peer's object is oversized" (`ObjectTooLarge`) from "the
network or the provider is down" (`StoreUnavailable`).

Messages never contain secrets. Text that came from a remote server is trimmed and stripped of
control characters before it reaches a message (`sanitize`), because a hostile endpoint chooses it.
"""

from __future__ import annotations

from codec.errors import TesseraError

__all__ = [
    "AccessDenied",
    "FetchTimeout",
    "InvalidKey",
    "ListingTooLarge",
    "ObjectExists",
    "ObjectNotFound",
    "ObjectTooLarge",
    "ReadOnlyStoreError",
    "StoreError",
    "StoreUnavailable",
    "TooSlow",
    "sanitize",
]


def sanitize(text: object, limit: int = 200) -> str:
    """Printable, bounded rendering of untrusted text for error messages and logs."""
    raw = str(text)
    clean = "".join(ch if ch.isprintable() else "?" for ch in raw[: limit + 1])
    return clean if len(clean) <= limit else clean[:limit] + "…"


class StoreError(TesseraError):
    """Base class for every object-store failure."""


class InvalidKey(StoreError, ValueError):
    """An object key or list prefix that breaks the key rules (see `protocol.stores.keys`)."""


class ObjectNotFound(StoreError):
    """The object (or its bucket) does not exist."""

    def __init__(self, key: str, where: str) -> None:
        super().__init__(f"object {key!r} not found in {where}")
        self.key = key


class ObjectExists(StoreError):
    """A create-only write (`ObjectStore.put_new`) found the key already stored."""

    def __init__(self, key: str, where: str) -> None:
        super().__init__(f"object {key!r} already exists in {where}")
        self.key = key


class ObjectTooLarge(StoreError):
    """The object is bigger than the byte cap the caller allowed; nothing was kept."""

    def __init__(self, key: str, max_bytes: int, size: int | None = None) -> None:
        seen = f"{size} bytes" if size is not None else "more bytes"
        super().__init__(f"object {key!r} has {seen}, above the cap of {max_bytes} bytes")
        self.key = key
        self.max_bytes = max_bytes
        self.size = size


class StoreUnavailable(StoreError):
    """The store could not be reached (or kept failing) after all retries."""


class ServerBusy(StoreUnavailable):
    """The server answered 429 or 5xx: a blip worth another try while the budget lasts."""


class FetchTimeout(StoreUnavailable):
    """The object did not arrive within the caller's wall-clock budget (`fetch_many`)."""


class TooSlow(StoreUnavailable):
    """The transfer fell below the caller's minimum rate after its grace period (`fetch_many`)."""


class AccessDenied(StoreError):
    """The credentials were rejected or lack the permission for this operation."""


class ReadOnlyStoreError(StoreError):
    """A write (put/delete) was attempted on a store opened with read-only credentials."""


class ListingTooLarge(StoreError):
    """A listing returned more entries than the caller's limit (a hostile or runaway bucket)."""
