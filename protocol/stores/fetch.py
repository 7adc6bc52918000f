"""Fetching many objects from other nodes' buckets under one hard wall-clock budget.

`fetch_many` is what a window's gather uses. Its guarantees, whatever an endpoint does:

- **budget**: it returns within ``budget_s + MARGIN_S`` of being called, with one result per
  request: the object (`Got`) or a typed `StoreError`;
- **minimum rate**: after ``grace_s``, a transfer that has received fewer than
  ``min_rate_bytes_s · (elapsed − grace_s)`` bytes (or all of them, if fewer) is cancelled
  (`TooSlow`); a server that drips its status line or headers counts as zero bytes;
- **byte cap**: an announced ``Content-Length`` above the cap is refused before the body is read,
  and the body is counted while it streams, so a server cannot push more than the cap;
- **one request**: one GET per object (no HEAD first), so ETag and Last-Modified describe exactly
  the bytes returned, and nothing can change between two requests; redirects are refused;
- **nothing left behind**: every request is an asyncio task cancelled at the budget; S3 requests
  run on aiohttp in the calling thread's own event loop, and no thread outlives the call.

S3-compatible stores (R2, S3, MinIO, and a hostile peer's own server) are read with aiohttp and
SigV4 signatures from botocore (`S3Store.signing_target`). Other stores are local (`file://`):
they are read in a private thread pool that is shut down before returning (local reads finish).

Threads could not give the budget guarantee: a blocked socket read in a worker thread cannot be
cancelled, so a hung endpoint would either hold the gather or leak the thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Hashable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime
from email.utils import parsedate_to_datetime
from typing import TypeVar

import aiohttp

from protocol.stores.base import ReadableStore
from protocol.stores.errors import (
    AccessDenied,
    ObjectNotFound,
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
    sanitize,
)
from protocol.stores.keys import validate_key
from protocol.stores.s3 import S3Store

__all__ = ["MARGIN_S", "FetchRequest", "FetchTimeout", "Got", "TooSlow", "fetch_many"]

K = TypeVar("K", bound=Hashable)
MARGIN_S = 0.5
"""The most `fetch_many` may run past its budget (cancellation and bookkeeping)."""
TICK_S = 0.05
CHUNK = 1 << 16
CONCURRENCY = 32


class FetchTimeout(StoreUnavailable):
    """The object did not arrive within the gather's budget."""


class TooSlow(StoreUnavailable):
    """The transfer fell below the minimum rate after the grace period."""


@dataclass(frozen=True)
class FetchRequest:
    store: ReadableStore
    key: str
    max_bytes: int


@dataclass(frozen=True)
class Got:
    """One object as one GET returned it."""

    data: bytes
    etag: str | None
    last_modified: datetime | None
    seconds: float


@dataclass
class _Progress:
    started: float
    received: int = 0
    total: int | None = None


def fetch_many(
    requests: Mapping[K, FetchRequest],
    *,
    budget_s: float,
    min_rate_bytes_s: float,
    grace_s: float,
) -> dict[K, Got | StoreError]:
    """Every request's object or typed error, within ``budget_s + MARGIN_S`` (see module doc)."""
    if not requests:
        return {}
    deadline = time.monotonic() + budget_s
    local = ThreadPoolExecutor(max_workers=4, thread_name_prefix="fetch-local")
    try:
        return asyncio.run(_fetch_all(requests, deadline, min_rate_bytes_s, grace_s, local))
    finally:  # local reads finish on their own; never wait for one past the budget
        local.shutdown(wait=False, cancel_futures=True)


async def _fetch_all(
    requests: Mapping[K, FetchRequest],
    deadline: float,
    min_rate: float,
    grace_s: float,
    local: ThreadPoolExecutor,
) -> dict[K, Got | StoreError]:
    connector = aiohttp.TCPConnector(limit=CONCURRENCY, limit_per_host=8)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=None, sock_read=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        keys = list(requests)
        tasks = [
            asyncio.create_task(_guarded(session, requests[k], deadline, min_rate, grace_s, local))
            for k in keys
        ]
        results = await asyncio.gather(*tasks)
    return dict(zip(keys, results, strict=True))


async def _guarded(
    session: aiohttp.ClientSession,
    req: FetchRequest,
    deadline: float,
    min_rate: float,
    grace_s: float,
    local: ThreadPoolExecutor,
) -> Got | StoreError:
    """One request under the budget and the rate watchdog; never raises."""
    progress = _Progress(started=time.monotonic())
    try:
        validate_key(req.key)
        if isinstance(req.store, S3Store):
            work = asyncio.ensure_future(_get_s3(session, req, progress))
        else:
            loop = asyncio.get_running_loop()
            work = loop.run_in_executor(local, _get_local, req, progress)
        return await _watch(work, req, progress, deadline, min_rate, grace_s)
    except StoreError as exc:
        return exc
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        return StoreUnavailable(f"{req.store.location}: {sanitize(type(exc).__name__)}")


async def _watch(
    work: asyncio.Future[Got],
    req: FetchRequest,
    progress: _Progress,
    deadline: float,
    min_rate: float,
    grace_s: float,
) -> Got:
    """Wait for `work`, cancelling it at the deadline or when it falls below the rate."""
    try:
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise FetchTimeout(f"{req.key!r} on {req.store.location}: no answer in time")
            done, _ = await asyncio.wait({work}, timeout=min(TICK_S, deadline - now))
            if done:
                return work.result()
            elapsed = time.monotonic() - progress.started
            owed = min_rate * (elapsed - grace_s)
            whole = progress.total if progress.total is not None else req.max_bytes
            if elapsed > grace_s and progress.received < min(owed, whole):
                raise TooSlow(
                    f"{req.key!r} on {req.store.location}: {progress.received} bytes in "
                    f"{elapsed:.1f}s, below {min_rate:.0f} B/s"
                )
    finally:
        work.cancel()


def _get_local(req: FetchRequest, progress: _Progress) -> Got:
    info = req.store.head(req.key)
    if info.size > req.max_bytes:
        raise ObjectTooLarge(req.key, req.max_bytes, info.size)
    data = req.store.get(req.key, req.max_bytes)
    progress.received = len(data)
    return Got(data, None, info.last_modified, time.monotonic() - progress.started)


async def _get_s3(session: aiohttp.ClientSession, req: FetchRequest, progress: _Progress) -> Got:
    store = req.store
    assert isinstance(store, S3Store)
    url, headers = store.signing_target().signed_get(req.key)
    async with session.get(url, headers=headers, allow_redirects=False) as resp:
        _check_status(resp.status, req, store)
        total = resp.content_length
        if total is not None and total > req.max_bytes:
            raise ObjectTooLarge(req.key, req.max_bytes, total)
        progress.total = total
        body = bytearray()
        async for chunk in resp.content.iter_chunked(CHUNK):
            body += chunk
            progress.received = len(body)
            if len(body) > req.max_bytes:
                raise ObjectTooLarge(req.key, req.max_bytes)
        if total is not None and len(body) != total:
            raise StoreUnavailable(f"{req.key!r}: {len(body)} of {total} bytes arrived")
        return Got(
            bytes(body),
            resp.headers.get("ETag"),
            _http_date(resp.headers.get("Last-Modified")),
            time.monotonic() - progress.started,
        )


def _check_status(status: int, req: FetchRequest, store: S3Store) -> None:
    if status == 200:
        return
    if status == 404:
        raise ObjectNotFound(req.key, store.location)
    if status == 403:
        raise AccessDenied(f"access denied to {req.key!r} on {store.location}")
    if 300 <= status < 400:
        raise StoreUnavailable(f"{store.location} answered a redirect (HTTP {status}): refused")
    raise StoreUnavailable(f"GET {req.key!r} on {store.location}: HTTP {status}")


def _http_date(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return parsed if parsed.tzinfo is not None else None
