"""Fetching many objects from other nodes' buckets under one hard wall-clock budget.

`fetch_many` is what a window's gather uses. Its guarantees, whatever an endpoint does (drip its
status line, headers or body, hang after accepting, lie about its length, redirect):

- **budget**: it returns within ``budget_s + MARGIN_S`` (0.5 s) of being called, with one result
  per request: the object (`Got`) or a typed `StoreError` (`ObjectNotFound`, `ObjectTooLarge`,
  `AccessDenied`, `FetchTimeout`, `TooSlow`, `StoreUnavailable` for an unreachable endpoint). It
  never raises for a bad endpoint; only bad arguments (a programming error) raise `ValueError`;
- **minimum rate**: a transfer's clock starts when it gets one of its pool's ``max_connections``
  slots (time spent queueing is not charged to it). After ``grace_s`` it must have received
  ``min_rate_bytes_s`` × its elapsed time on average (or the whole object, if smaller), checked
  every `TICK_S`, else it is cancelled (`TooSlow`) and frees its slot. Bytes of a dripped status
  line or header block count as zero;
- **pools and fair shares**: requests may be put in pools (``pools``: key → pool name, e.g. the
  window's selected updates apart from the rest); each pool has its own ``max_connections``
  slots, so no request of one pool waits for another's. In a pool of ``n > max_connections``
  requests, a transfer that has held its slot for its share of the budget,
  ``budget_s · max_connections / n``, while another request of its pool waits is
  cancelled (`TooSlow`): endpoints that send just above the minimum rate can hold the slots for
  one share each, not for the whole budget, so every request of the pool gets a slot within the
  budget. Slots are granted in the order of ``requests`` (the caller shuffles it if it must not
  be predictable);
- **byte cap**: an announced ``Content-Length`` above ``max_bytes`` is refused before the body is
  read; the body is counted while it streams and refused at byte ``max_bytes + 1``, so a server
  that announces no length cannot push more; bytes beyond an announced length are never read;
- **spool**: a request with a ``spool`` path has its body written to that new file as it arrives,
  under the same cap, watchdog and deadline, and never held whole in memory; a transfer that
  fails or is cancelled removes its partial file (`protocol.stores.spool`). A spool file that
  cannot be written is the caller's fault, not the peer's: `SpoolError` is raised, not returned;
- **one request**: one signed GET per object (no HEAD first), so ETag and Last-Modified describe
  exactly the bytes returned and nothing can change between two requests; a server that answers
  429 or 5xx (`ServerBusy`, a blip) is asked again every `RETRY_S`, off its slot, while the
  budget lasts, and each answer stands for itself; a redirect is an error
  (never followed); responses are taken as stored (``Accept-Encoding: identity``, no decoding);
- **endpoints**: a store with an `EndpointPolicy` (every peer's bucket) is contacted only when
  its URL passes the policy and every address its name resolves to does, and the connection goes
  to exactly those addresses (`protocol.endpoints`); a refused endpoint is `StoreUnavailable`;
- **nothing left behind**: no thread outlives the call. Name lookups and local file reads run in
  daemon threads (`protocol.stores.fetch_threads`) that are joined before returning; a file read
  stops at its next 1 MiB chunk when abandoned. The one exception is a thread stuck inside a
  system call (a DNS lookup the system resolver has not given up on): it is left behind, as a
  daemon, rather than stretching the budget, and logged.

Why asyncio rather than threads: a worker thread blocked in a socket read cannot be cancelled, and
socket timeouts bound each read, not the whole request (a server sending one header line per
second never trips a 2 s read timeout). Every transfer here is an asyncio task on one event loop
in the calling thread; cancelling it at its deadline closes its connection at once.

S3-compatible stores (R2, S3, MinIO, or a hostile peer's own server) are read with aiohttp at
path-style URLs, signed with botocore's SigV4 signer (`S3Store.signing_target`). `file://` stores
are read directly (cap checked by fstat first); any other store through its own blocking `get`.

`fetch_many` runs its own event loop: call it from synchronous code (from a coroutine, use
``await asyncio.to_thread(fetch_many, ...)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Hashable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar
from urllib.parse import urlsplit

import aiohttp

from protocol.endpoints import EndpointPolicy
from protocol.stores.base import check_max_bytes
from protocol.stores.errors import (
    FetchTimeout,
    ServerBusy,
    StoreError,
    StoreUnavailable,
    TooSlow,
    sanitize,
)
from protocol.stores.fetch_io import get_s3, read_file, read_other
from protocol.stores.fetch_threads import DaemonResolver, DaemonThreads
from protocol.stores.fetch_types import FetchRequest, Got, Progress
from protocol.stores.file import FileStore
from protocol.stores.keys import validate_key
from protocol.stores.s3 import S3Store
from protocol.stores.spool import SpoolError

__all__ = [
    "MARGIN_S",
    "MAX_CONNECTIONS",
    "FetchRequest",
    "FetchTimeout",
    "Got",
    "TooSlow",
    "fetch_many",
]

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

MARGIN_S = 0.5
"""The most `fetch_many` may run past its budget: the sum of the bounds below, with slack."""
RETRY_S = 0.5
"""How long a request waits, off its slot, before asking a busy server (429/5xx) again."""
TICK_S = 0.05
"""How often each transfer's rate is checked (and the last wait past the deadline)."""
MAX_CONNECTIONS = 32
"""Transfers in flight at once (the default of `fetch_many`'s ``max_connections``)."""
_CLOSE_S = 0.1  # closing the connections after the last result
_TEARDOWN_S = 0.1  # cancelled leftovers and async generators, when the loop is torn down
_JOIN_S = 0.2  # joining the worker threads
_RESERVE_S = 0.02  # returning


@dataclass(frozen=True)
class _Limits:
    deadline: float  # time.monotonic() / loop.time()
    min_rate: float
    grace_s: float
    max_connections: int


@dataclass
class _Pool:
    """One pool's slots, its requests' fair share of the budget, and how many wait for a slot."""

    slots: asyncio.Semaphore
    share_s: float
    waiting: int = 0


@dataclass(frozen=True)
class _Context:
    limits: _Limits
    session: aiohttp.ClientSession
    threads: DaemonThreads


def fetch_many(
    requests: Mapping[K, FetchRequest],
    *,
    budget_s: float,
    min_rate_bytes_s: float,
    grace_s: float,
    max_connections: int = MAX_CONNECTIONS,
    pools: Mapping[K, Hashable] | None = None,
    on_done: Callable[[K, Got | StoreError], None] | None = None,
) -> dict[K, Got | StoreError]:
    """Every request's object or typed error, within ``budget_s + MARGIN_S`` (see module doc);
    ``pools`` names each request's pool (all in one pool when None). ``on_done`` is called, on
    the caller's thread, with each request's outcome as soon as its transfer ends, an object or
    an error (a consumer can start on an object while the others still arrive; a transfer
    cancelled at the end of the budget is only in the result); it must be quick and must not
    raise."""
    _check_limits(budget_s, min_rate_bytes_s, grace_s, max_connections)
    for req in requests.values():
        check_max_bytes(req.max_bytes)
    _check_spools(requests.values())
    if not requests:
        return {}
    started = time.monotonic()
    limits = _Limits(started + budget_s, min_rate_bytes_s, grace_s, max_connections)
    threads = DaemonThreads()
    resolver = DaemonResolver(threads, _policies(requests.values()))
    try:
        pool_of = {key: pools.get(key) if pools is not None else None for key in requests}
        return _run_bounded(_fetch_all(requests, pool_of, limits, threads, resolver, on_done))
    finally:
        hard_end = started + budget_s + MARGIN_S - _RESERVE_S
        threads.join(min(hard_end, time.monotonic() + _JOIN_S))


def _policies(requests: Iterable[FetchRequest]) -> dict[str, EndpointPolicy]:
    """The endpoint policy of every host a request goes to (the strictest, should two differ)."""
    out: dict[str, EndpointPolicy] = {}
    for req in requests:
        store = req.store
        if not isinstance(store, S3Store) or store.endpoint_policy is None:
            continue
        policy = store.endpoint_policy
        host = urlsplit(store.signing_target().endpoint).hostname or ""
        if host not in out or out[host].allow_private:
            out[host] = policy
    return out


def _check_spools(requests: Iterable[FetchRequest]) -> None:
    """Every spool path is new, distinct, and in an existing directory."""
    paths = [req.spool for req in requests if req.spool is not None]
    if len(set(paths)) != len(paths):
        raise ValueError("two requests spool to the same file")
    for path in paths:
        if not path.parent.is_dir() or os.path.lexists(path):
            raise ValueError(f"spool file {path} exists, or its directory does not")


def _check_limits(budget_s: float, min_rate: float, grace_s: float, connections: int) -> None:
    for name, value in (
        ("budget_s", budget_s),
        ("min_rate_bytes_s", min_rate),
        ("grace_s", grace_s),
    ):
        if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if isinstance(connections, bool) or not isinstance(connections, int) or connections < 1:
        raise ValueError(f"max_connections must be an int >= 1, got {connections!r}")


def _run_bounded(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run`, with a teardown that cannot block (asyncio.run's waits without limit)."""
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            leftovers = [task for task in asyncio.all_tasks(loop) if not task.done()]
            for task in leftovers:
                task.cancel()
            _run_briefly(loop, *leftovers, loop.shutdown_asyncgens())
        finally:
            loop.close()


def _run_briefly(loop: asyncio.AbstractEventLoop, *work: Any) -> None:
    tasks = [asyncio.ensure_future(w, loop=loop) for w in work]
    loop.run_until_complete(asyncio.wait(tasks, timeout=_TEARDOWN_S))


def _pools(pool_of: Mapping[K, Hashable], limits: _Limits, budget_s: float) -> dict[Any, _Pool]:
    """Each pool's slots and fair share (no share when its requests all get a slot at once)."""
    sizes = Counter(pool_of.values())
    slots = limits.max_connections
    return {
        name: _Pool(
            asyncio.Semaphore(slots),
            budget_s * slots / n if n > slots else math.inf,
        )
        for name, n in sizes.items()
    }


async def _fetch_all(
    requests: Mapping[K, FetchRequest],
    pool_of: Mapping[K, Hashable],
    limits: _Limits,
    threads: DaemonThreads,
    resolver: DaemonResolver,
    on_done: Callable[[K, Got | StoreError], None] | None = None,
) -> dict[K, Got | StoreError]:
    loop = asyncio.get_running_loop()
    budget_s = max(0.0, limits.deadline - time.monotonic())
    deadline = loop.time() + budget_s  # the loop's clock
    limits = _Limits(deadline, limits.min_rate, limits.grace_s, limits.max_connections)
    pools = _pools(pool_of, limits, budget_s)
    async with _session(resolver) as session:
        ctx = _Context(limits, session, threads)
        tasks = {
            key: asyncio.create_task(_one(req, ctx, pools[pool_of[key]]))
            for key, req in requests.items()
        }
        if on_done is not None:
            for key, task in tasks.items():
                task.add_done_callback(partial(_report, on_done, key, requests[key]))
        await asyncio.wait(tasks.values(), timeout=max(0.0, deadline - loop.time()) + TICK_S)
        for task in tasks.values():
            task.cancel()  # only a task that outstayed its own deadline is still running
    return {key: _outcome(task, requests[key]) for key, task in tasks.items()}


@contextlib.asynccontextmanager
async def _session(resolver: DaemonResolver) -> AsyncIterator[aiohttp.ClientSession]:
    """An aiohttp session with no timeouts of its own (the callers' deadlines rule), no pooled
    connections, no DNS cache, lookups (and endpoint checks) by `resolver`; closed within
    `_CLOSE_S` at the end."""
    connector = aiohttp.TCPConnector(
        limit=0, force_close=True, use_dns_cache=False, resolver=resolver
    )
    no_timeouts = aiohttp.ClientTimeout(total=None, connect=None, sock_connect=None, sock_read=None)
    session = aiohttp.ClientSession(
        connector=connector, timeout=no_timeouts, auto_decompress=False, trust_env=False
    )
    try:
        yield session
    finally:
        closing = asyncio.ensure_future(_close(session, connector))
        await asyncio.wait({closing}, timeout=_CLOSE_S)


async def _close(session: aiohttp.ClientSession, connector: aiohttp.TCPConnector) -> None:
    await connector.close(abort_ssl=True)
    await session.close()


def _report(
    on_done: Callable[[Any, Got | StoreError], None],
    key: Any,
    req: FetchRequest,
    task: asyncio.Task[Got | StoreError],
) -> None:
    """A finished transfer's outcome to the caller's callback (a cancelled one is not reported:
    it ran past the deadline and is in the final result)."""
    if not task.cancelled():
        on_done(key, _outcome(task, req))


def _outcome(task: asyncio.Task[Got | StoreError], req: FetchRequest) -> Got | StoreError:
    if task.done() and not task.cancelled():
        return task.result()  # `_one` returns its errors; only BaseExceptions propagate
    return FetchTimeout(f"{req.key!r} on {sanitize(req.store.location)}: no answer in time")


async def _one(req: FetchRequest, ctx: _Context, pool: _Pool) -> Got | StoreError:
    """One request under the deadline, the rate watchdog and its pool's fair share; returns its
    error, never raises."""
    scope = asyncio.timeout_at(ctx.limits.deadline)
    try:
        validate_key(req.key)
        async with scope:
            while True:
                try:
                    return await _in_slot(req, ctx, pool)
                except ServerBusy:
                    if asyncio.get_running_loop().time() + RETRY_S >= ctx.limits.deadline:
                        raise
                await asyncio.sleep(RETRY_S)
    except StoreError as exc:
        return exc
    except SpoolError:
        raise  # ours, not the peer's
    except TimeoutError as exc:
        if scope.expired():
            return FetchTimeout(f"{req.key!r} on {sanitize(req.store.location)}: no answer in time")
        return _unavailable(req, exc)
    except Exception as exc:  # aiohttp.ClientError, OSError, a malformed answer: all the peer's
        return _unavailable(req, exc)


def _unavailable(req: FetchRequest, exc: Exception) -> StoreUnavailable:
    return StoreUnavailable(
        f"GET {req.key!r} on {sanitize(req.store.location)}: "
        f"{type(exc).__name__}: {sanitize(exc, 120)}"
    )


async def _in_slot(req: FetchRequest, ctx: _Context, pool: _Pool) -> Got:
    """Wait for a slot of the pool, then run the watched transfer in it."""
    pool.waiting += 1
    try:
        await pool.slots.acquire()
    finally:
        pool.waiting -= 1
    try:
        return await _watched(req, ctx, pool)
    finally:
        pool.slots.release()


async def _watched(req: FetchRequest, ctx: _Context, pool: _Pool) -> Got:
    """Run the transfer; cancel it once it falls below the minimum rate, or once it has held its
    slot for its share of the budget while another request of its pool waits."""
    progress = Progress(started=time.monotonic())
    work = asyncio.ensure_future(_transfer(req, ctx, progress))
    try:
        while True:
            done, _ = await asyncio.wait({work}, timeout=TICK_S)
            if done:
                return work.result()
            _check_rate(req, progress, ctx.limits)
            _check_share(req, progress, pool)
    finally:
        progress.cancelled.set()  # a file read stops at its next chunk
        work.cancel()


def _check_share(req: FetchRequest, progress: Progress, pool: _Pool) -> None:
    elapsed = time.monotonic() - progress.started
    if pool.waiting and elapsed > pool.share_s:
        raise TooSlow(
            f"{req.key!r} on {sanitize(req.store.location)}: {progress.received} bytes in "
            f"{elapsed:.1f} s, its share of the budget, while others waited for a connection"
        )


def _check_rate(req: FetchRequest, progress: Progress, limits: _Limits) -> None:
    elapsed = time.monotonic() - progress.started
    if elapsed <= limits.grace_s or limits.min_rate <= 0:
        return
    whole = progress.total if progress.total is not None else req.max_bytes
    owed = min(limits.min_rate * elapsed, max(whole, 1))
    if progress.received < owed:
        raise TooSlow(
            f"{req.key!r} on {sanitize(req.store.location)}: {progress.received} bytes in "
            f"{elapsed:.1f} s, below {limits.min_rate:.0f} B/s"
        )


async def _transfer(req: FetchRequest, ctx: _Context, progress: Progress) -> Got:
    store = req.store
    if isinstance(store, S3Store):
        return await get_s3(ctx.session, store, req.key, req.max_bytes, progress, req.spool)
    read = read_file if isinstance(store, FileStore) else read_other
    return await ctx.threads.run(read, store, req.key, req.max_bytes, progress, req.spool)
