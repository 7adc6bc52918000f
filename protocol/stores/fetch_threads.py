"""The only threads `fetch_many` starts: daemon threads it joins before returning.

Two things cannot be done without blocking calls: name resolution (`socket.getaddrinfo`) and
reading local files. Both run here, one daemon thread per call, never in the event loop's default
executor: `asyncio.run`'s teardown waits for that executor (without limit before Python 3.12,
300 s since), so a DNS lookup stuck in the system resolver (a hostile bucket owner controls its
endpoint's name servers) would hold the whole gather. `DaemonThreads.join` waits for every thread, but only until a deadline: a
thread still stuck in a system call then is left behind (it is a daemon, so it never holds the
process at exit) and logged; that is the one case where a thread outlives the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from aiohttp.abc import AbstractResolver, ResolveResult

from protocol.endpoints import EndpointPolicy

__all__ = ["DaemonResolver", "DaemonThreads"]

T = TypeVar("T")
log = logging.getLogger(f"tessera.{__name__}")

_NUMERIC = socket.AI_NUMERICHOST | socket.AI_NUMERICSERV


class DaemonThreads:
    """Runs blocking calls for one event loop in daemon threads, and joins them (bounded)."""

    def __init__(self, name: str = "fetch") -> None:
        self._name = name
        self._threads: list[threading.Thread] = []

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """`fn(*args)` in a new daemon thread; a future of the running loop gets its outcome."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def target() -> None:
            try:
                outcome: tuple[bool, Any] = (True, fn(*args))
            except BaseException as exc:  # handed to the awaiting coroutine, never lost
                outcome = (False, exc)
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_settle, future, *outcome)

        name = f"{self._name}-{getattr(fn, '__name__', 'call')}-{len(self._threads)}"
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)
        return future

    def join(self, deadline: float) -> list[threading.Thread]:
        """Wait for every thread until `deadline` (monotonic); returns those still running."""
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t for t in self._threads if t.is_alive()]
        for thread in alive:
            log.warning("%s is still blocked in a system call; left behind", thread.name)
        self._threads = alive
        return alive


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # cancelled meanwhile
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class DaemonResolver(AbstractResolver):
    """aiohttp's threaded resolver, on `DaemonThreads` instead of the loop's default executor.

    A host with an `EndpointPolicy` in `policies` (a peer's endpoint) resolves only if every
    address of the lookup passes the policy; aiohttp then connects to exactly these addresses,
    so the check and the connection see one lookup (no DNS rebinding)."""

    def __init__(
        self, threads: DaemonThreads, policies: Mapping[str, EndpointPolicy] | None = None
    ) -> None:
        self._threads = threads
        self._policies = dict(policies or {})

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        infos = await self._threads.run(
            socket.getaddrinfo, host, port, family, socket.SOCK_STREAM, 0, socket.AI_ADDRCONFIG
        )
        policy = self._policies.get(host)
        if policy is not None:
            policy.check_addresses([str(info[4][0]) for info in infos])
        hosts: list[ResolveResult] = []
        for fam, _, proto, _, address in infos:
            if fam == socket.AF_INET6 and (len(address) < 4 or address[3]):
                continue  # no IPv6 in this build, or a link-local address (needs a scope)
            hosts.append(
                ResolveResult(
                    hostname=host,
                    host=str(address[0]),
                    port=int(address[1]),
                    family=fam,
                    proto=proto,
                    flags=_NUMERIC,
                )
            )
        if not hosts:
            raise OSError(f"no usable address for {host!r}")
        return hosts

    async def close(self) -> None:
        return None
