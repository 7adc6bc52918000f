"""Which endpoints a node may contact on a peer's behalf: the one policy for every peer bucket.

A bucket commitment names an endpoint chosen by whoever posted it, so contacting it blindly would
let any peer make every validator and miner connect to addresses inside their own networks (cloud
metadata services, admin ports) and publish what happened. `EndpointPolicy` decides, in this order:

1. **scheme and port**: ``https`` on port 443 only (``http`` and other ports only in local mode);
2. **host spelling**: a host is a DNS name of lowercase labels, or an IPv4 address written as a
   canonical dotted quad. Anything else whose last label is numeric (``127.1``, ``0177.0.0.1``,
   ``0x7f.1``, ``10.1``, ``169.254.43518``: spellings the system resolver turns into loopback,
   private or link-local addresses) is refused, as are ``localhost``, ``*.localhost`` and
   single-label names; IPv6 literals are not part of the commitment grammar and are refused;
3. **addresses**: a name is resolved (in a daemon thread, for at most ``resolve_timeout_s``) and
   *every* address it resolves to must be globally routable (`is_routable`); an IP literal must
   be too;
4. **pinning**: the caller connects to exactly the addresses this check returned, never to a
   second lookup of the name, so a name that answers a public address to the check and a private
   one to the connection (DNS rebinding) cannot redirect it. TLS still verifies the certificate
   against the host name.

Redirects are refused by the transports themselves (`protocol.stores.pinned`,
`protocol.stores.fetch_io`), in local mode too. **Local mode** (`EndpointPolicy.local`, chosen by
``TESSERA_ALLOW_PRIVATE_ENDPOINTS=1`` or a simulation's local storage root) skips steps 1 to 3 for
simulations and LANs on loopback or private addresses, and still pins and refuses redirects.
"""

from __future__ import annotations

import ipaddress
import queue
import re
import socket
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from codec.errors import TesseraError

__all__ = [
    "ALLOW_PRIVATE_ENV",
    "EndpointPolicy",
    "EndpointRefused",
    "is_routable",
    "split_host",
]

ALLOW_PRIVATE_ENV = "TESSERA_ALLOW_PRIVATE_ENDPOINTS"
"""Set to ``1`` for local mode (see docker/.env.example)."""

HTTPS_PORT = 443
RESOLVE_TIMEOUT_S = 5.0
MAX_ADDRESSES = 32
"""More addresses than this for one name is refused (nothing legitimate needs them)."""

_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_NAME = re.compile(rf"{_LABEL}(?:\.{_LABEL})*")
_NUMERIC_LABEL = re.compile(r"[0-9]+|0x[0-9a-f]*")
_V6_UNICAST = ipaddress.ip_network("2000::/3")


class EndpointRefused(TesseraError, ValueError):
    """An endpoint the policy does not let this node contact (the message is for local logs)."""


def split_host(hostport: str) -> tuple[str, int | None]:
    """``host[:port]`` into its host and port (None when absent); `EndpointRefused` if malformed."""
    host, sep, port = hostport.rpartition(":") if ":" in hostport else (hostport, "", "")
    if not sep:
        return hostport, None
    if not port.isdigit() or port.startswith("0") or not 1 <= int(port) <= 65535:
        raise EndpointRefused("malformed port")
    return host, int(port)


def _literal(host: str) -> ipaddress.IPv4Address | None:
    """The address a host spells when it is an IP literal, None for a DNS name.

    Only a canonical dotted quad is an address; any other host whose last label looks numeric is
    refused, because the system resolver would read it as an address in a legacy notation."""
    if len(host) > 253 or _NAME.fullmatch(host) is None:
        raise EndpointRefused("host is not a lowercase DNS name or dotted-quad IPv4 address")
    if _NUMERIC_LABEL.fullmatch(host.rsplit(".", 1)[-1]) is None:
        return None
    try:  # only the canonical dotted quad parses: no leading zeros or short forms (Python >= 3.9.5)
        return ipaddress.IPv4Address(host)
    except ValueError:
        raise EndpointRefused("numeric host is not a canonical dotted-quad address") from None


def is_routable(address: str) -> bool:
    """Whether `address` (as a resolver returns it) is a globally routable unicast address.

    IPv6 must be global unicast (2000::/3) and must not embed an IPv4 address (6to4, Teredo;
    IPv4-mapped and NAT64 addresses lie outside 2000::/3), whose IPv4 part could be private."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:  # a scoped IPv6 address ("fe80::1%eth0") or garbage
        return False
    if not ip.is_global or ip.is_multicast:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        return ip in _V6_UNICAST and ip.sixtofour is None and ip.teredo is None
    return True


@dataclass(frozen=True)
class EndpointPolicy:
    """What may be contacted; `production()` for real runs, `local()` for simulations and LANs."""

    allow_private: bool = False
    ports: frozenset[int] = field(default_factory=lambda: frozenset({HTTPS_PORT}))
    resolve_timeout_s: float = RESOLVE_TIMEOUT_S

    @classmethod
    def production(cls) -> EndpointPolicy:
        return cls()

    @classmethod
    def local(cls) -> EndpointPolicy:
        return cls(allow_private=True)

    @classmethod
    def of(cls, allow_private: bool) -> EndpointPolicy:
        return cls.local() if allow_private else cls.production()

    def check_host(self, host: str, port: int | None) -> None:
        """Steps 1 to 3 for what can be checked without a lookup (port, spelling, literals)."""
        if self.allow_private:
            return
        if (HTTPS_PORT if port is None else port) not in self.ports:
            raise EndpointRefused(f"port {port} is not allowed (only {sorted(self.ports)})")
        address = _literal(host)
        if address is not None:
            if not is_routable(str(address)):
                raise EndpointRefused("address is not globally routable")
            return
        if host == "localhost" or host.endswith(".localhost") or "." not in host:
            raise EndpointRefused("host is local or a single label")

    def check_url(self, url: str) -> tuple[str, str, int]:
        """The scheme, host and port of a URL this policy lets us contact (before any lookup)."""
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError:
            raise EndpointRefused("malformed URL") from None
        host = parts.hostname or ""
        allowed = ("https", "http") if self.allow_private else ("https",)
        if parts.scheme not in allowed:
            raise EndpointRefused(f"scheme {parts.scheme!r} is not allowed")
        if parts.username is not None or parts.password is not None or ":" in host:
            raise EndpointRefused("URL has credentials or an IPv6 literal")
        self.check_host(host, port)
        default = HTTPS_PORT if parts.scheme == "https" else 80
        return parts.scheme, host, default if port is None else port

    def check_addresses(self, addresses: Sequence[str]) -> None:
        """Every address a name resolved to must be routable (step 3)."""
        if not addresses:
            raise EndpointRefused("the name resolved to no address")
        if len(addresses) > MAX_ADDRESSES:
            raise EndpointRefused("the name resolved to too many addresses")
        if self.allow_private:
            return
        if not all(is_routable(a) for a in addresses):
            raise EndpointRefused("the name resolves to an address that is not globally routable")

    def resolve(self, host: str, port: int) -> list[str]:
        """The checked addresses to connect to for `host` (the connection must use only these)."""
        if not self.allow_private and _literal(host) is not None:
            self.check_addresses([host])
            return [host]
        infos = _getaddrinfo_bounded(host, port, self.resolve_timeout_s)
        addresses = [str(info[4][0]) for info in infos]
        self.check_addresses(addresses)
        return list(dict.fromkeys(addresses))


def _getaddrinfo_bounded(host: str, port: int, timeout_s: float) -> list[tuple]:
    """`socket.getaddrinfo` in a daemon thread, abandoned after `timeout_s` (a hostile name
    server can stall a lookup far longer)."""
    answers: queue.SimpleQueue[tuple[bool, object]] = queue.SimpleQueue()

    def lookup() -> None:
        try:
            answers.put((True, socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)))
        except OSError as exc:
            answers.put((False, exc))

    threading.Thread(target=lookup, name="endpoint-resolve", daemon=True).start()
    try:
        ok, value = answers.get(timeout=timeout_s)
    except queue.Empty:
        raise EndpointRefused(f"name lookup took longer than {timeout_s:g} s") from None
    if not ok:
        raise EndpointRefused(f"name lookup failed: {value}")
    return list(value)  # type: ignore[call-overload]
