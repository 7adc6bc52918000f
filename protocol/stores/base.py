"""The object-store interface every backend implements.

`ReadableStore` is the read half (get, get_to_file, head, list); `ObjectStore` adds the writes
(put, put_file, delete). `open_store` is typed so that a store opened with `ReadCredentials` is a
`ReadableStore`: a type checker rejects `store.put(...)` on it, and at run time the backend raises
`ReadOnlyStoreError` before sending any request.

Semantics shared by all backends (the contract tests in tests/unit/test_stores_contract.py pin them):

- keys follow `protocol.stores.keys.validate_key`; a bad key raises `InvalidKey` before any I/O;
- `get(key, max_bytes)` never holds or transfers much more than `max_bytes` (+ one read buffer):
  an object above the cap raises `ObjectTooLarge`, a missing one `ObjectNotFound`;
- `get_to_file` writes to a temporary file next to `path` and renames it into place; on any
  failure no file (neither `path` nor the temporary) is left behind and `path` is untouched;
- `put` is atomic: readers see the old object or the new one, never a mix;
- `put_new` stores only if the key is free (S3's ``If-None-Match: *``), else `ObjectExists`:
  a retried write whose first answer was lost never replaces (and re-dates) what it stored;
- `delete` is idempotent (deleting a missing key is not an error), as in S3;
- `head`/`list` report sizes and UTC-aware `last_modified` timestamps; `list` returns entries
  sorted by key, skips entries whose keys break the key rules, and raises `ListingTooLarge`
  beyond `limit` entries.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import UTC, datetime

from protocol.stores.errors import ObjectNotFound, StoreError

__all__ = ["DEFAULT_LIST_LIMIT", "ObjectInfo", "ObjectStore", "ReadableStore"]

DEFAULT_LIST_LIMIT = 100_000


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a store knows about one object."""

    key: str
    size: int
    last_modified: datetime

    def __post_init__(self) -> None:
        if self.size < 0:
            raise StoreError(f"object {self.key!r} reports a negative size")
        if self.last_modified.tzinfo is None:
            raise StoreError("last_modified must be timezone-aware")
        if self.last_modified.utcoffset() != UTC.utcoffset(None):
            object.__setattr__(self, "last_modified", self.last_modified.astimezone(UTC))


def check_max_bytes(max_bytes: int) -> int:
    """Validate a byte cap argument (a non-negative int)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
        raise ValueError(f"max_bytes must be a non-negative int, got {max_bytes!r}")
    return max_bytes


class ReadableStore(ABC):
    """Read access to one bucket."""

    @property
    @abstractmethod
    def location(self) -> str:
        """Human-readable, secret-free description of the bucket (for messages and logs)."""

    @property
    @abstractmethod
    def read_only(self) -> bool:
        """True when writes are refused (store opened with read-only credentials)."""

    @abstractmethod
    def get(self, key: str, max_bytes: int) -> bytes:
        """The object's bytes; `ObjectTooLarge` if it has more than `max_bytes`."""

    @abstractmethod
    def get_to_file(self, key: str, path: str | os.PathLike[str], max_bytes: int) -> int:
        """Download the object atomically to `path`; returns its size."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and last-modified time of an object."""

    @abstractmethod
    def list(self, prefix: str = "", *, limit: int = DEFAULT_LIST_LIMIT) -> list[ObjectInfo]:
        """All objects whose key starts with `prefix`, sorted by key."""

    def exists(self, key: str) -> bool:
        """True if the object exists."""
        try:
            self.head(key)
        except ObjectNotFound:
            return False
        return True

    def close(self) -> None:  # noqa: B027 - optional hook, not abstract
        """Release pooled resources (connections, threads)."""

    def __enter__(self) -> ReadableStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "read-write"
        return f"{type(self).__name__}({self.location}, {mode})"


class ObjectStore(ReadableStore):
    """Read and write access to one bucket."""

    @abstractmethod
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store `data` under `key`, replacing any previous object atomically."""

    @abstractmethod
    def put_new(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Store `data` under `key` only if no object is stored there; `ObjectExists` if one is
        (perhaps our own earlier try, whose answer was lost)."""

    @abstractmethod
    def put_file(self, key: str, path: str | os.PathLike[str]) -> int:
        """Upload a local file (multipart for large files); returns the number of bytes sent."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; a missing key is not an error."""

    def __enter__(self) -> ObjectStore:
        return self
