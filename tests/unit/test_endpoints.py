"""A peer's endpoint is contacted only as `protocol.endpoints.EndpointPolicy` allows.

Everything stays on loopback: name lookups go to a resolver the test controls (`socket.getaddrinfo`
patched), and a firewall (`socket.socket.connect` patched) refuses, and records, every connection
to an address that is not loopback, so "the connection went to the public address" is observed
without leaving the machine. Both transports are exercised: the asyncio gather
(`protocol.stores.fetch.fetch_many`) and botocore through `protocol.stores.pinned`.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.sim.slow_store import SlowStore
from node.window.gather import checked
from protocol.credentials import ReadCredentials
from protocol.endpoints import EndpointPolicy, EndpointRefused, is_routable, split_host
from protocol.runconfig import RunConfig
from protocol.stores import RetryPolicy, S3Config, S3Store, StoreError, StoreUnavailable
from protocol.stores.fetch import FetchRequest, Got, fetch_many
from validator.checks import Verdict, classify_fetch

READ = ReadCredentials(access_key_id="reader", secret_access_key="reader-secret")
KEY = "run/w1/update/obj.tsr"
PUBLIC = "8.8.8.8"  # routable; the firewall below keeps every connection to it on this machine
FAST = S3Config(connect_timeout=0.5, read_timeout=1.0, botocore_max_attempts=2,
                retry=RetryPolicy(attempts=2, base_delay=0.0))  # fmt: skip
BYPASSES = ["127.1", "0177.0.0.1", "0x7f.1", "10.1", "169.254.43518"]


class Listener:
    """A TCP server on a free loopback port that counts connections and closes them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept
        self.sock.close()
        self._thread.join(5)


@pytest.fixture
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


class Network:
    """The resolver and firewall the test controls."""

    def __init__(self) -> None:
        self.names: dict[str, list[list[str]]] = {}  # name -> answers, the last one repeats
        self.lookups: list[str] = []
        self.blocked: list[tuple[str, int]] = []  # connections the firewall refused
        self.failing: set[str] = set()  # names whose lookup fails
        self.stalled: set[str] = set()  # names whose lookup hangs until the test ends
        self.release = threading.Event()  # ends every hanging lookup
        self.hanging: set[str] = set()  # names whose lookup is hanging now


@pytest.fixture
def network(monkeypatch: pytest.MonkeyPatch) -> Iterator[Network]:
    net = Network()
    real_lookup, real_connect = socket.getaddrinfo, socket.socket.connect

    def lookup(host: Any, port: Any, *args: Any, **kwargs: Any) -> list[tuple]:
        if host not in net.names:
            return real_lookup(host, port, *args, **kwargs)
        net.lookups.append(host)
        if host in net.failing:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        if host in net.stalled:
            net.hanging.add(host)
            net.release.wait(60.0)
            net.hanging.discard(host)
        answers = net.names[host]
        addresses = answers.pop(0) if len(answers) > 1 else answers[0]
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, int(port or 0))) for a in addresses]

    def connect(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in (
            "127.0.0.1",
            "::1",
        ):
            net.blocked.append((address[0], address[1]))
            raise ConnectionRefusedError(111, "refused by the test firewall")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", lookup)
    monkeypatch.setattr(socket.socket, "connect", connect)
    yield net
    net.release.set()


def _store(endpoint: str, policy: EndpointPolicy) -> S3Store:
    return S3Store("bucket", READ, endpoint=endpoint, config=FAST, endpoint_policy=policy)


def _gather(store: S3Store) -> Got | StoreError:
    got = fetch_many({0: FetchRequest(store, KEY, 1 << 20)}, budget_s=2.0,
                     min_rate_bytes_s=1024, grace_s=1.0)  # fmt: skip
    return got[0]


def _via_boto(store: S3Store) -> StoreError:
    with pytest.raises(StoreError) as info:
        store.get(KEY, 1 << 20)
    return info.value


# -- what is refused before any lookup ----------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [f"https://{h}/" for h in BYPASSES]
    + [
        "https://127.0.0.1/", "https://10.0.0.1/", "https://169.254.169.254/",
        "https://100.64.0.1/", "https://0.0.0.0/", "https://255.255.255.255/",
        "https://8.8.8.08/",  # a leading zero: not canonical, even for a public address
        "https://localhost/", "https://a.localhost/", "https://minio/",
        "https://s3.example.org:8443/", "https://s3.example.org:80/",
        "http://s3.example.org/",  # plain http
        "https://user:pw@s3.example.org/", "https://[::1]/", "ftp://s3.example.org/",
    ],
)  # fmt: skip
def test_refused_before_any_lookup(url: str, network: Network) -> None:
    with pytest.raises(EndpointRefused):
        EndpointPolicy.production().check_url(url)
    with pytest.raises(EndpointRefused):  # a peer's store cannot even be opened on it
        _store(url.rstrip("/"), EndpointPolicy.production())
    assert network.lookups == [] and network.blocked == []


@pytest.mark.parametrize(
    ("host", "rule"),
    [
        ("127.1", "not a canonical dotted-quad"),  # the resolver would read 127.0.0.1
        ("0177.0.0.1", "not a canonical dotted-quad"),
        ("8.8.8.08", "not a canonical dotted-quad"),
        ("1.2.3", "not a canonical dotted-quad"),
        ("s3_x.example.org", "not a lowercase DNS name"),
        ("s3.example.org.", "not a lowercase DNS name"),
        ("S3.example.org", "not a lowercase DNS name"),
    ],
)
def test_each_host_is_refused_by_its_rule(host: str, rule: str) -> None:
    with pytest.raises(EndpointRefused, match=rule):
        EndpointPolicy.production().check_host(host, None)


@pytest.mark.parametrize("hostport", ["s3.example.org:0443", "s3.example.org:", "s3.example.org:x",
                                      "s3.example.org:65536", "s3.example.org:+443"])  # fmt: skip
def test_a_committed_host_with_a_malformed_port_is_refused(hostport: str) -> None:
    with pytest.raises(EndpointRefused, match="malformed port"):
        split_host(hostport)
    assert split_host("s3.example.org:443") == ("s3.example.org", 443)
    assert split_host("s3.example.org") == ("s3.example.org", None)


@pytest.mark.parametrize(
    "url",
    ["https://s3.us-east-1.amazonaws.com", f"https://{PUBLIC}",
     "https://0123456789abcdef0123456789abcdef.r2.cloudflarestorage.com",
     "https://s3.example.org:443", "https://10.example.org"],
)  # fmt: skip
def test_public_https_endpoints_pass_the_static_check(url: str) -> None:
    EndpointPolicy.production().check_url(url)


def test_local_mode_is_an_explicit_opt_in() -> None:
    local = EndpointPolicy.local()
    assert local.check_url("http://127.0.0.1:9000") == ("http", "127.0.0.1", 9000)
    assert EndpointPolicy.of(False) == EndpointPolicy.production() != local


@pytest.mark.parametrize(
    ("address", "routable"),
    [
        ("8.8.8.8", True), ("2001:4860:4860::8888", True),
        ("127.0.0.1", False), ("10.1.2.3", False), ("172.16.0.1", False),
        ("192.168.1.1", False), ("169.254.169.254", False), ("100.64.0.1", False),
        ("0.0.0.0", False), ("224.0.0.1", False), ("192.0.2.1", False),
        ("::1", False), ("fe80::1", False), ("fe80::1%eth0", False), ("fc00::1", False),
        ("::ffff:127.0.0.1", False),  # IPv4-mapped
        ("::ffff:8.8.8.8", False),  # mapped, even when public: refused as a form
        ("64:ff9b::7f00:1", False),  # NAT64 of 127.0.0.1
        ("2002:7f00:1::1", False),  # 6to4 of 127.0.0.1
        ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False),  # Teredo
        ("::7f00:1", False),  # IPv4-compatible
        ("ff0e::1", False), ("not an address", False),
    ],
)  # fmt: skip
def test_only_globally_routable_unicast_addresses(address: str, routable: bool) -> None:
    assert is_routable(address) is routable


# -- lookups: every address checked, the connection pinned to them --------------------------------


def test_each_lookup_outcome_is_refused_by_its_rule(network: Network) -> None:
    """No answer, too many answers (a hostile name server's fan-out), a failed lookup and one
    that hangs: each is one `EndpointRefused`, the last while its lookup still hangs."""
    policy = dataclasses.replace(EndpointPolicy.production(), resolve_timeout_s=0.3)
    network.names["none.test.example"] = [[]]
    network.names["many.test.example"] = [[f"8.8.{i // 250}.{i % 250 + 1}" for i in range(33)]]
    network.names["gone.test.example"] = [[PUBLIC]]
    network.failing.add("gone.test.example")
    network.names["slow.test.example"] = [[PUBLIC]]
    network.stalled.add("slow.test.example")
    for name, rule in [
        ("none.test.example", "resolved to no address"),
        ("many.test.example", "too many addresses"),
        ("gone.test.example", "name lookup failed"),
        ("slow.test.example", "took longer than 0.3 s"),
    ]:
        with pytest.raises(EndpointRefused, match=rule):
            policy.resolve(name, 443)
    assert network.hanging == {"slow.test.example"}  # refused while its lookup still hangs
    network.names["fine.test.example"] = [[PUBLIC, PUBLIC]]
    assert policy.resolve("fine.test.example", 443) == [PUBLIC]


def test_a_url_that_does_not_parse_is_refused_as_malformed() -> None:
    for url in ("https://s3.example.org:x/", "https://s3.example.org:443443/", "https://[::1/"):
        with pytest.raises(EndpointRefused, match="malformed URL"):
            EndpointPolicy.production().check_url(url)


def test_a_name_resolving_to_a_private_address_is_never_contacted(
    network: Network, listener: Listener
) -> None:
    network.names["inside.test.example"] = [["127.0.0.1"]]
    policy = EndpointPolicy(ports=frozenset({listener.port}))  # production rules, the test's port
    store = _store(f"https://inside.test.example:{listener.port}", policy)
    assert isinstance(_gather(store), StoreUnavailable)
    assert isinstance(_via_boto(store), StoreUnavailable)
    assert network.lookups and listener.accepted == 0


def test_every_resolved_address_must_be_routable(network: Network, listener: Listener) -> None:
    network.names["mixed.test.example"] = [[PUBLIC, "127.0.0.1"]]
    store = _store(
        f"https://mixed.test.example:{listener.port}",
        EndpointPolicy(ports=frozenset({listener.port})),
    )
    assert isinstance(_gather(store), StoreUnavailable)
    assert isinstance(_via_boto(store), StoreUnavailable)
    assert network.blocked == [] and listener.accepted == 0  # not even the public one was tried


def test_rebinding_cannot_redirect_the_connection(network: Network, listener: Listener) -> None:
    """The name answers a public address once, then loopback: the connection goes to the
    address that was checked, and the loopback answer is refused, on both transports."""
    port = listener.port
    policy = EndpointPolicy(ports=frozenset({port}))
    for transport in (_gather, _via_boto):
        network.names["rebind.test.example"] = [[PUBLIC], ["127.0.0.1"]]
        network.blocked.clear()
        first = transport(_store(f"https://rebind.test.example:{port}", policy))
        assert isinstance(first, StoreUnavailable)
        assert network.blocked and set(network.blocked) == {(PUBLIC, port)}  # pinned
        again = transport(_store(f"https://rebind.test.example:{port}", policy))
        assert isinstance(again, StoreUnavailable)  # the loopback answer is refused
    assert listener.accepted == 0


def test_only_port_443_in_production(network: Network, listener: Listener) -> None:
    network.names["public.test.example"] = [[PUBLIC]]
    for port in (listener.port, 80, 8443):
        with pytest.raises(EndpointRefused):
            _store(f"https://public.test.example:{port}", EndpointPolicy.production())
    store = _store("https://public.test.example", EndpointPolicy.production())
    assert isinstance(_via_boto(store), StoreUnavailable)  # 443 is tried (and firewalled)
    assert set(network.blocked) == {(PUBLIC, 443)} and listener.accepted == 0


def test_a_redirect_is_refused_in_local_mode_too(tmp_path: Path) -> None:
    (tmp_path / "bucket" / KEY).parent.mkdir(parents=True)
    (tmp_path / "bucket" / KEY).write_bytes(b"payload")
    server = SlowStore(tmp_path, "redirect")  # 307 to the same object, served when followed
    with server as endpoint:
        store = _store(endpoint, EndpointPolicy.local())
        assert isinstance(_gather(store), StoreError)
        assert isinstance(_via_boto(store), StoreUnavailable)
    assert server.requests and all("followed" not in seen.target for seen in server.requests)


@pytest.mark.parametrize("status", ["301 Moved Permanently", "302 Found", "303 See Other",
                                    "308 Permanent Redirect"])  # fmt: skip
def test_no_redirect_reaches_its_target(status: str, listener: Listener) -> None:
    def redirect(conn: socket.socket) -> None:
        conn.recv(65536)
        where = f"http://127.0.0.1:{listener.port}/bucket/{KEY}"
        conn.sendall(f"HTTP/1.1 {status}\r\nLocation: {where}\r\nContent-Length: 0\r\n"
                     "Connection: close\r\n\r\n".encode())  # fmt: skip

    sock, port = _serve_each(redirect)
    try:
        store = _store(f"http://127.0.0.1:{port}", EndpointPolicy.local())
        assert isinstance(_gather(store), StoreError)
        assert isinstance(_via_boto(store), StoreUnavailable)
    finally:
        sock.close()
    assert listener.accepted == 0


def test_local_mode_reads_a_loopback_bucket(tmp_path: Path) -> None:
    (tmp_path / "bucket" / KEY).parent.mkdir(parents=True)
    (tmp_path / "bucket" / KEY).write_bytes(b"payload")
    with SlowStore(tmp_path, "normal") as endpoint:
        store = _store(endpoint, EndpointPolicy.local())
        got = _gather(store)
        assert isinstance(got, Got) and got.data == b"payload"
        assert store.get(KEY, 1 << 20) == b"payload"
        assert [o.key for o in store.list("run/")] == [KEY]


# -- what reports say -------------------------------------------------------------------------------


def _self_signed(tmp_path: Path) -> ssl.SSLContext:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(1)
        .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    (tmp_path / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (tmp_path / "key.pem").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tmp_path / "cert.pem", tmp_path / "key.pem")
    return ctx


def _serve_each(handle: Any) -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)

    def loop() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            try:
                handle(conn)
            except OSError:
                pass
            finally:
                conn.close()

    threading.Thread(target=loop, daemon=True).start()
    return sock, sock.getsockname()[1]


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")


def test_reports_say_unreachable_whatever_listens(tmp_path: Path) -> None:
    """Closed, resetting, banner-speaking and TLS ports give different errors locally, and one
    and the same text in what a validator publishes (the fetch reason and the verdict detail)."""
    tls = _self_signed(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = probe.getsockname()[1]
    servers = {
        "reset": _serve_each(_reset),
        "banner": _serve_each(lambda c: c.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")),
        "tls": _serve_each(lambda c: tls.wrap_socket(c, server_side=True).recv(1)),
    }
    endpoints = {
        "closed": f"http://127.0.0.1:{closed}",
        "reset": f"http://127.0.0.1:{servers['reset'][1]}",
        "banner": f"http://127.0.0.1:{servers['banner'][1]}",
        "tls": f"https://127.0.0.1:{servers['tls'][1]}",
        "tls-as-http": f"http://127.0.0.1:{servers['tls'][1]}",
    }
    try:
        stores = {n: _store(e, EndpointPolicy.local()) for n, e in endpoints.items()}
        got = fetch_many({n: FetchRequest(s, KEY, 1 << 20) for n, s in stores.items()},
                         budget_s=3.0, min_rate_bytes_s=1024, grace_s=2.0)  # fmt: skip
    finally:
        for sock, _ in servers.values():
            sock.close()
    assert len({str(e) for e in got.values()}) == len(got)  # the local detail tells them apart
    run = RunConfig.preset("tiny")
    published = set()
    for e in got.values():
        assert isinstance(e, StoreUnavailable)
        fetched = checked(0, "hotkey", e, run, None, 1, 0.0)  # type: ignore[arg-type]
        verdict, detail = classify_fetch(fetched)
        assert verdict is Verdict.UNREACHABLE
        published.add((fetched.reason, detail))
    assert published == {("unreachable", "unreachable")}
