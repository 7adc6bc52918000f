"""An S3 endpoint with a provider's ordinary faults, for `tessera sim --faults store-errors`.

A reverse proxy on loopback in front of a real S3 server (moto's, started in-process, or the
``--storage`` endpoint), which forwards every request as it came and injects, by a fixed schedule
so that a run is reproducible, what a provider does on a bad day:

* ``503 SlowDown`` to the first try of about a quarter of the object reads, writes and listings;
* a lost answer: about one write in ten is stored, and then the connection is dropped before the
  answer (the writer cannot tell it landed);
* throttling: about one write in ten waits `THROTTLE_S` before it is forwarded.

The proxy also stands in for the provider's key policy: a request signed with the read key that
is not a read is refused with ``403 AccessDenied`` (moto without IAM would accept it), so the
simulation's members still prove that the key they publish on chain cannot write.

    with FlakyS3(upstream, read_key_id) as endpoint:   # "http://127.0.0.1:PORT"
        ...
    proxy.faults  # counts of each injected fault
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import Any
from unittest.mock import patch
from urllib.parse import parse_qs

import aiohttp
import yarl
from aiohttp import web

__all__ = [
    "FAIL_SHARE", "THROTTLE_S", "FlakyS3", "flaky_storage", "scheduled", "start_embedded_s3",
]  # fmt: skip

FAIL_SHARE = 0.25
"""Share of objects (and listings) whose first request is answered 503 SlowDown."""
LOST_SHARE = THROTTLE_SHARE = 0.1
"""Shares of objects whose first write loses its answer, or waits `THROTTLE_S`."""
THROTTLE_S = 3.0
_CREDENTIAL = re.compile(r"Credential=([^/,\s]+)/")
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}
"""Headers of one connection, not forwarded (Host is: it is part of the request's signature)."""
_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
_DENIED = (
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
    b"<Message>The read key may not write.</Message></Error>"
)


def _draw(text: str) -> float:
    """A fixed number in [0, 1) for `text`: the schedule's dice."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") / 2**64


def scheduled(method: str, what: str) -> str | None:
    """The fault the first ``method`` request for `what` (``"METHOD /bucket/key"``, with
    ``?prefix=`` for a listing) gets: ``"503"``, ``"lost answer"``, ``"throttled"`` or None."""
    if method not in ("GET", "PUT", "POST", "DELETE"):
        return None
    draw = _draw(what)
    if draw < FAIL_SHARE:
        return "503"
    writes = method in ("PUT", "POST")
    if writes and draw < FAIL_SHARE + LOST_SHARE:
        return "lost answer"
    if writes and draw < FAIL_SHARE + LOST_SHARE + THROTTLE_SHARE:
        return "throttled"
    return None


class FlakyS3:
    """The proxy, served from its own thread and event loop while the ``with`` block runs."""

    def __init__(
        self, upstream: str, read_key_id: str | None, throttle_s: float = THROTTLE_S
    ) -> None:
        self.upstream, self.read_key_id = upstream.rstrip("/"), read_key_id
        self.throttle_s = throttle_s
        self.endpoint = ""
        self.faults: Counter[str] = Counter()
        self._tries: Counter[str] = Counter()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flaky-s3", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def __enter__(self) -> str:
        self._thread.start()
        self.endpoint = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self.endpoint

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    async def _start(self) -> str:
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self._session = aiohttp.ClientSession(auto_decompress=False)
        port = self._runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    async def _stop(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()

    def _fault(self, request: web.Request) -> str | None:
        """The fault this request gets: on the first try of a drawn object only."""
        what = f"{request.method} {request.path}"
        if request.method == "GET" and "list-type" in request.query:
            what += f"?prefix={request.query.get('prefix', '')}"
        self._tries[what] += 1
        return scheduled(request.method, what) if self._tries[what] == 1 else None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        found = _CREDENTIAL.search(request.headers.get("Authorization", ""))
        if found and found.group(1) == self.read_key_id and request.method not in ("GET", "HEAD"):
            return web.Response(status=403, body=_DENIED, content_type="application/xml")
        body = await request.read()
        fault = self._fault(request)
        if fault is not None:
            self.faults[fault] += 1
        if fault == "503":
            return web.Response(status=503, body=_SLOW_DOWN, content_type="application/xml")
        if fault == "throttled":
            await asyncio.sleep(self.throttle_s)
        status, headers, answer = await self._forward(request, body)
        if fault == "lost answer" and request.transport is not None:
            request.transport.close()  # stored upstream; the writer never hears of it
            return web.Response(status=status)
        response = web.Response(status=status, body=answer if request.method != "HEAD" else None)
        for name, value in headers:
            response.headers.add(name, value)
        return response

    async def _forward(
        self, request: web.Request, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        assert self._session is not None
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP]
        async with self._session.request(
            request.method,
            # as sent: requoting the query (a list's ``prefix=a%2F``) would break its signature
            yarl.URL(self.upstream + request.rel_url.raw_path_qs, encoded=True),
            headers=headers,
            data=body,
            allow_redirects=False,
            skip_auto_headers=("Content-Type", "Accept-Encoding", "User-Agent"),
        ) as upstream:
            answer = await upstream.read()
            hop = _HOP - {"content-length"} if request.method == "HEAD" else _HOP  # the size
            kept = [(k, v) for k, v in upstream.headers.items() if k.lower() not in hop]
            return upstream.status, kept, answer


def start_embedded_s3() -> tuple[Any, str]:
    """moto's S3 server on a free loopback port (the simulation's embedded provider); returns the
    server (stop it with ``server.stop()``) and its endpoint. `SystemExit` with the fix when moto
    is not installed."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise SystemExit(
            "--faults store-errors on embedded storage needs moto's S3 server: "
            "pip install 'moto[server]', or pass --storage s3://PREFIX?endpoint=URL"
        ) from None
    import logging

    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


_SIM_KEYS = {
    "TESSERA_S3_ACCESS_KEY_ID": "sim-write",
    "TESSERA_S3_SECRET_ACCESS_KEY": "sim-write-secret",
    "TESSERA_S3_READ_ACCESS_KEY_ID": "sim-read",
    "TESSERA_S3_READ_SECRET_ACCESS_KEY": "sim-read-secret",
}


@contextmanager
def flaky_storage(storage: str) -> Iterator[tuple[str, FlakyS3]]:
    """The ``--storage`` value that puts every member's bucket behind a `FlakyS3` proxy, and the
    proxy, for the ``with`` block. On ``file`` storage the upstream is moto's server started here,
    and the write and read keys are the simulation's own (moto without IAM takes any key; the
    proxy refuses the read key's writes)."""
    with ExitStack() as stack:
        if storage == "file":
            server, upstream = start_embedded_s3()
            stack.callback(server.stop)
            stack.enter_context(patch.dict(os.environ, _SIM_KEYS))
            prefix, query = "tessera-sim", ""
        else:
            prefix, _, query = storage.removeprefix("s3://").partition("?")
            upstream = parse_qs(query)["endpoint"][-1]
        proxy = FlakyS3(upstream, os.environ.get("TESSERA_S3_READ_ACCESS_KEY_ID"))
        endpoint = stack.enter_context(proxy)
        rest = "".join(f"&{k}={v[-1]}" for k, v in parse_qs(query).items() if k != "endpoint")
        yield f"s3://{prefix}?endpoint={endpoint}{rest}", proxy
