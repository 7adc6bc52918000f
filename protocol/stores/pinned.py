"""botocore requests to a peer's bucket over connections pinned to checked addresses.

An `S3Store` opened with an `EndpointPolicy` (every store built from a peer's commitment) sends
its requests through `PinnedTransport`, a botocore ``before-send`` handler: botocore still builds,
signs, retries and parses every request, but the connection is made here, to exactly the addresses
`EndpointPolicy.resolve` checked, never to a second lookup of the name (no DNS rebinding), with the
certificate verified against the host name, without proxies from the environment, and with every
redirect refused (in local mode too).
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any
from urllib.parse import urlsplit

from botocore.awsrequest import AWSPreparedRequest, AWSResponse
from botocore.exceptions import (
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
    SSLError,
)
from urllib3 import HTTPConnectionPool, HTTPSConnectionPool, Retry, Timeout
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.exceptions import ConnectTimeoutError as Urllib3ConnectTimeout
from urllib3.exceptions import NewConnectionError, ProtocolError
from urllib3.exceptions import ReadTimeoutError as Urllib3ReadTimeout
from urllib3.exceptions import SSLError as Urllib3SSLError
from urllib3.util.connection import create_connection

from protocol.endpoints import EndpointPolicy, EndpointRefused
from protocol.stores.s3_config import S3Config

__all__ = ["PinnedTransport"]

PIN_TTL_S = 60.0
"""How long one lookup's addresses serve new connections before the name is looked up again."""
_MAX_POOLS = 8


class _PinnedMixin:
    """Connects to the addresses it was given instead of looking its host up again."""

    host: str
    port: int
    timeout: float | None
    source_address: tuple[str, int] | None
    socket_options: Any

    def __init__(self, *args: Any, pinned: tuple[str, ...], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pinned = pinned

    def _new_conn(self) -> socket.socket:
        last: OSError | None = None
        for address in self._pinned:
            try:
                return create_connection(
                    (address, self.port),
                    self.timeout,
                    source_address=self.source_address,
                    socket_options=self.socket_options,
                )
            except OSError as exc:
                last = exc
        if isinstance(last, TimeoutError):
            raise Urllib3ConnectTimeout(self, f"connecting to {self.host} timed out")
        raise NewConnectionError(self, f"cannot connect to {self.host}: {last}")  # type: ignore[arg-type]


class _PinnedHTTPS(_PinnedMixin, HTTPSConnection):
    pass


class _PinnedHTTP(_PinnedMixin, HTTPConnection):
    pass


class _PinnedHTTPSPool(HTTPSConnectionPool):
    ConnectionCls = _PinnedHTTPS


class _PinnedHTTPPool(HTTPConnectionPool):
    ConnectionCls = _PinnedHTTP


class PinnedTransport:
    """The ``before-send`` handler of one store (see the module docstring)."""

    def __init__(self, policy: EndpointPolicy, config: S3Config) -> None:
        self._policy = policy
        self._timeout = Timeout(connect=config.connect_timeout, read=config.read_timeout)
        self._maxsize = max(10, 2 * config.max_concurrency)
        self._pools: dict[tuple[str, str, int], tuple[float, HTTPConnectionPool]] = {}
        self._lock = threading.Lock()

    def __call__(self, request: AWSPreparedRequest, **_: Any) -> AWSResponse:
        scheme, host, port = self._policy.check_url(request.url)
        pool = self._pool(scheme, host, port)
        parts = urlsplit(request.url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        headers = request.headers
        try:
            raw = pool.urlopen(
                method=request.method,
                url=target,
                body=request.body,
                headers=headers,
                retries=Retry(total=False, redirect=False),
                redirect=False,
                assert_same_host=False,
                preload_content=False,
                decode_content=False,
                chunked=headers.get("Transfer-Encoding", b"") in (b"chunked", "chunked"),
                enforce_content_length=False,
            )
        except Urllib3SSLError as exc:
            raise SSLError(endpoint_url=request.url, error=exc) from exc
        except NewConnectionError as exc:
            raise EndpointConnectionError(endpoint_url=request.url, error=exc) from exc
        except Urllib3ConnectTimeout as exc:
            raise ConnectTimeoutError(endpoint_url=request.url, error=exc) from exc
        except Urllib3ReadTimeout as exc:
            raise ReadTimeoutError(endpoint_url=request.url, error=exc) from exc
        except ProtocolError as exc:
            raise ConnectionClosedError(
                error=exc, request=request, endpoint_url=request.url
            ) from exc
        if 300 <= raw.status < 400:
            raw.close()  # never read a redirect's body, never reuse its connection
            raise EndpointRefused(f"redirect (HTTP {raw.status}) refused")
        response = AWSResponse(request.url, raw.status, raw.headers, raw)
        if not request.stream_output:
            response.content  # noqa: B018 - read the whole body now, as botocore does
        return response

    def _pool(self, scheme: str, host: str, port: int) -> HTTPConnectionPool:
        """A pool whose connections go to the addresses of one fresh, checked lookup."""
        key = (scheme, host, port)
        now = time.monotonic()
        with self._lock:
            entry = self._pools.get(key)
            if entry is not None and now - entry[0] < PIN_TTL_S:
                return entry[1]
        pinned = tuple(self._policy.resolve(host, port))
        cls = _PinnedHTTPSPool if scheme == "https" else _PinnedHTTPPool
        pool = cls(host, port, timeout=self._timeout, maxsize=self._maxsize, pinned=pinned)
        with self._lock:
            old = self._pools.pop(key, None)
            if len(self._pools) >= _MAX_POOLS:
                self.close()
            self._pools[key] = (now, pool)
        if old is not None:
            old[1].close()
        return pool

    def close(self) -> None:
        for _, pool in self._pools.values():
            pool.close()
        self._pools.clear()
