"""One transfer of `fetch_many`: a signed GET with aiohttp, or a read of a local file.

Neither takes more than ``max_bytes`` bytes of an object: an announced size above the cap is
refused before the body is read, and the body is counted while it arrives (a server that
announces no length, or more than it sends, cannot push more). The body goes into a `Sink`: into
memory, or into the request's spool file, chunk by chunk, so a spooled body is never held whole
(`protocol.stores.spool`); a transfer that fails or is cancelled leaves no spool file. Both report
what they received in `Progress` for the rate watchdog. Neither has its own timeouts:
`fetch_many` cancels them.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path

import aiohttp
from multidict import CIMultiDictProxy
from yarl import URL

from protocol.stores.base import ReadableStore
from protocol.stores.errors import (
    AccessDenied,
    ObjectNotFound,
    ObjectTooLarge,
    ServerBusy,
    StoreError,
    StoreUnavailable,
)
from protocol.stores.fetch_types import Got, Progress
from protocol.stores.file import FileStore
from protocol.stores.s3 import S3Store
from protocol.stores.spool import Sink

__all__ = ["get_s3", "read_file", "read_other"]

CHUNK = 1 << 16
"""Bytes read from a response at a time."""
FILE_CHUNK = 1 << 20
"""Bytes read from a local file at a time (the most a cancelled read still reads)."""
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)
_MAX_ETAG = 1024


async def get_s3(
    session: aiohttp.ClientSession,
    store: S3Store,
    key: str,
    max_bytes: int,
    progress: Progress,
    spool: Path | None,
) -> Got:
    """One signed GET of `key`, path-style, redirects refused. A peer's endpoint passed its
    policy when the store was opened; its addresses are checked when the connector resolves it."""
    url, headers = store.signing_target().signed_get(key)
    headers["Accept-Encoding"] = "identity"  # the stored bytes, never a server-chosen encoding
    async with session.get(URL(url, encoded=True), headers=headers, allow_redirects=False) as resp:
        check_status(resp.status, key, store.location)
        announced = resp.content_length
        if announced is not None and announced > max_bytes:
            raise ObjectTooLarge(key, max_bytes, announced)
        progress.total = announced
        with Sink(spool) as sink:
            # a body shorter than its Content-Length raises aiohttp's ClientPayloadError, an
            # outage (tests/unit/test_fetch_io_rules.py); bodies are never decompressed
            await read_capped(resp.content, key, max_bytes, progress, sink)
            body = sink.finish()
        return Got(
            body,
            etag_of(resp.headers),
            http_date(resp.headers.get("Last-Modified")),
            time.monotonic() - progress.started,
        )


async def read_capped(
    content: aiohttp.StreamReader, key: str, max_bytes: int, progress: Progress, sink: Sink
) -> None:
    """The whole body into `sink`, or `ObjectTooLarge` as soon as byte ``max_bytes + 1``
    arrives (that byte is never stored)."""
    while chunk := await content.read(min(CHUNK, max_bytes + 1 - sink.size)):
        progress.received = sink.size + len(chunk)
        if progress.received > max_bytes:
            raise ObjectTooLarge(key, max_bytes)
        sink.write(chunk)


def check_status(status: int, key: str, location: str) -> None:
    """Map an HTTP status to a store error (only 200 is an object)."""
    if status == 200:
        return
    if status == 404:
        raise ObjectNotFound(key, location)
    if status in (401, 403):
        raise AccessDenied(f"access denied (HTTP {status}) to {key!r} on {location}")
    if 300 <= status < 400:
        raise StoreError(f"{location} answered a redirect (HTTP {status}) for {key!r}: refused")
    if status == 429 or status >= 500:
        raise ServerBusy(f"GET {key!r} on {location}: HTTP {status}")
    raise StoreError(f"GET {key!r} on {location}: unexpected HTTP {status}")


def etag_of(headers: CIMultiDictProxy[str]) -> str | None:
    value = headers.get("ETag")
    if value is None or len(value) > _MAX_ETAG or not value.isprintable():
        return None
    return value


def http_date(value: str | None) -> datetime | None:
    """An HTTP date as a UTC-aware datetime; None if absent or unparsable."""
    if not value or len(value) > 64:
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if parsed.tzinfo is None:  # "-0000": UTC, source unknown
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC)


def read_file(
    store: FileStore, key: str, max_bytes: int, progress: Progress, spool: Path | None
) -> Got:
    """Read a `FileStore` object (blocking; run in a worker thread), cap checked by fstat first.

    Reads in `FILE_CHUNK` pieces and stops at the next piece once `progress.cancelled` is set."""
    path = store.directory.joinpath(*key.split("/"))
    try:
        fd = os.open(path, _RDONLY)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        raise ObjectNotFound(key, store.location) from None
    except OSError as exc:
        raise StoreError(f"cannot open {key!r} in {store.location}: {exc.strerror}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFound(key, store.location)
        if st.st_size > max_bytes:
            raise ObjectTooLarge(key, max_bytes, st.st_size)
        progress.total = st.st_size
        with Sink(spool) as sink:
            md5 = _read_fd(fd, key, max_bytes, progress, sink)
            body = sink.finish()
    finally:
        os.close(fd)
    modified = datetime.fromtimestamp(st.st_mtime, UTC)
    return Got(body, f'"{md5}"', modified, time.monotonic() - progress.started)


def _read_fd(fd: int, key: str, max_bytes: int, progress: Progress, sink: Sink) -> str:
    """The file's bytes into `sink`; returns their MD5 (hex)."""
    md5 = hashlib.md5(usedforsecurity=False)
    while not progress.cancelled.is_set():
        chunk = os.read(fd, min(FILE_CHUNK, max_bytes + 1 - sink.size))
        if not chunk:
            return md5.hexdigest()
        progress.received = sink.size + len(chunk)
        if progress.received > max_bytes:  # grew after the fstat
            raise ObjectTooLarge(key, max_bytes)
        md5.update(chunk)
        sink.write(chunk)
    raise StoreUnavailable(f"reading {key!r} was cancelled")


def read_other(
    store: ReadableStore, key: str, max_bytes: int, progress: Progress, spool: Path | None
) -> Got:
    """Any other `ReadableStore`: its own `get` (blocking; not cancellable, only abandoned; the
    body is whole in memory once before it is spooled)."""
    data = store.get(key, max_bytes)
    progress.received = len(data)
    with Sink(spool) as sink:
        sink.write(data)
        del data
        body = sink.finish()
    return Got(body, None, None, time.monotonic() - progress.started)
