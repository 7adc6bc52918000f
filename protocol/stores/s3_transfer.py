"""Building blocks of parallel transfers: download sinks, exact body reads, a parallel runner.

Nothing here talks to S3 by itself; `protocol.stores.s3` drives these with its client.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import Any, Protocol, TypeVar

from protocol.stores.errors import StoreError

__all__ = [
    "Cancelled",
    "FileSink",
    "MemorySink",
    "ShortRead",
    "Sink",
    "parse_content_range",
    "pread_exact",
    "read_exact",
    "run_parallel",
]

T = TypeVar("T")
READ_CHUNK = 1 << 20
_CONTENT_RANGE = re.compile(r"bytes (\d{1,19})-(\d{1,19})/(\d{1,19})")


class ShortRead(Exception):
    """The body ended before the announced length (a dropped connection): transient."""


class Cancelled(Exception):
    """A sibling part failed; this part stopped early. Never surfaces to callers."""


class Sink(Protocol):
    """Where downloaded bytes go: positioned writes into a preallocated area."""

    def allocate(self, size: int) -> None: ...

    def write(self, offset: int, data: memoryview) -> None: ...


class MemorySink:
    """A preallocated bytearray (allocated only after the size passed the byte cap)."""

    def __init__(self) -> None:
        self.buffer = bytearray()

    def allocate(self, size: int) -> None:
        self.buffer = bytearray(size)

    def write(self, offset: int, data: memoryview) -> None:
        self.buffer[offset : offset + len(data)] = data


class FileSink:
    """A file descriptor, preallocated to the object size, filled with positioned writes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def allocate(self, size: int) -> None:
        os.ftruncate(self.fd, 0)
        if size == 0:
            return
        try:
            os.posix_fallocate(self.fd, 0, size)  # reserve the disk space: ENOSPC now, not later
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise
            os.ftruncate(self.fd, size)  # the file system cannot preallocate: sparse file

    def write(self, offset: int, data: memoryview) -> None:
        while data:
            written = os.pwrite(self.fd, data, offset)
            data = data[written:]
            offset += written


def parse_content_range(value: object) -> tuple[int, int, int]:
    """(first, last, total) from "bytes first-last/total"; `StoreError` on anything else."""
    match = _CONTENT_RANGE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise StoreError("server sent a malformed Content-Range header")
    first, last, total = (int(g) for g in match.groups())
    if not first <= last < total:
        raise StoreError("server sent an inconsistent Content-Range header")
    return first, last, total


def read_exact(
    body: Any,
    sink: Sink,
    offset: int,
    length: int,
    *,
    what: str,
    on_bytes: Callable[[int], None],
    cancelled: Callable[[], bool] | None = None,
) -> None:
    """Read exactly `length` bytes of `body` into `sink` at `offset`.

    Never asks the body for more than what is left of `length`, so a lying server cannot push
    more than that into memory; a body that ends early raises `ShortRead` (transient), one that
    has bytes beyond `length` raises `StoreError`.
    """
    scratch = bytearray(min(READ_CHUNK, max(length, 1)))
    view = memoryview(scratch)
    done = 0
    while done < length:
        if cancelled is not None and cancelled():
            raise Cancelled
        got = body.readinto(view[: min(len(scratch), length - done)])
        if not got:
            raise ShortRead(f"{what}: body ended after {done} of {length} bytes")
        sink.write(offset + done, view[:got])
        done += got
        on_bytes(got)
    if body.read(1):
        raise StoreError(f"{what}: the server sent more bytes than it announced")


def run_parallel(
    fn: Callable[..., T],
    items: Sequence[tuple[Any, ...]],
    *,
    workers: int,
    failed: threading.Event,
) -> list[T]:
    """`fn(*item)` for every item on up to `workers` threads; results in item order.

    On the first failure `failed` is set (workers poll it to stop early), queued items are
    cancelled, running ones are awaited, and that first exception is raised.
    """
    if not items:
        return []
    workers = max(1, min(workers, len(items)))
    if workers == 1:
        return [fn(*item) for item in items]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tessera-s3") as pool:
        futures = [pool.submit(fn, *item) for item in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        early = [f.exception() for f in futures if f in done and f.exception() is not None]
        if early:
            failed.set()
            for future in futures:
                future.cancel()
            wait(futures)
            late = [f.exception() for f in futures if not f.cancelled() and f.exception()]
            # the first failure observed, never a sibling's Cancelled
            real = [e for e in [*early, *late] if e is not None and not isinstance(e, Cancelled)]
            raise (real or early)[0]  # type: ignore[misc]
        return [f.result() for f in futures]


@contextlib.contextmanager
def closing_body(response: dict[str, Any]) -> Any:
    """Close a GetObject body on exit: an unread body closes its connection, so whatever is
    left of a too-large or hostile response is never downloaded."""
    body = response["Body"]
    try:
        yield body
    finally:
        with contextlib.suppress(Exception):
            body.close()


def pread_exact(fd: int, offset: int, length: int) -> bytes:
    """`length` bytes of the open file `fd` from `offset`; `StoreError` if the file ends first
    (it shrank while it was uploaded)."""
    if length == 0:
        return b""
    chunks: list[bytes] = []
    done = 0
    while done < length:
        chunk = os.pread(fd, length - done, offset + done)
        if not chunk:
            raise StoreError("local file shrank while it was uploaded")
        chunks.append(chunk)
        done += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
