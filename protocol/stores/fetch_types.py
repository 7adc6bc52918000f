"""The values `protocol.stores.fetch.fetch_many` takes and returns, and its per-transfer progress."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from protocol.stores.base import ReadableStore
from protocol.stores.spool import Body

__all__ = ["FetchRequest", "Got", "Progress"]


@dataclass(frozen=True)
class FetchRequest:
    """One object to fetch: from `store`, under `key`, at most `max_bytes` bytes of it; with
    `spool`, its body goes to that new file as it arrives (`protocol.stores.spool`) instead of
    into memory."""

    store: ReadableStore
    key: str
    max_bytes: int
    spool: Path | None = None


@dataclass(frozen=True)
class Got:
    """One object as one GET returned it.

    `body` holds the bytes, or names the spool file they went to (`FetchRequest.spool`); `data`
    reads them (back). `etag` is the ETag header as sent (quoted, like boto3's); for `file://` stores it is the
    quoted MD5 of the bytes, as S3 gives for a single-part upload. `last_modified` is UTC-aware,
    or None when the server sent none (or an unparsable one). `seconds` is the transfer's own
    duration, from when it got a connection slot to its last byte.
    """

    body: Body
    etag: str | None
    last_modified: datetime | None
    seconds: float

    @property
    def data(self) -> bytes:
        return self.body.read()


@dataclass
class Progress:
    """What one transfer has received so far; read by the rate watchdog on the event loop.

    `cancelled` is set when the transfer is abandoned, so that a reader in a worker thread stops
    at its next chunk."""

    started: float
    received: int = 0
    total: int | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
