"""`fetch_many` against a real S3 server (moto), hostile endpoints on loopback and real files.

A gather never runs past its budget plus `MARGIN_S`, whatever an endpoint does; honest objects in
the same call all arrive; an object costs one signed GET; the byte cap holds against lying
servers; redirects are refused; no thread outlives the call.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from lab.sim.slow_store import SeenRequest, SlowStore
from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import (
    AccessDenied,
    FileStore,
    InvalidKey,
    ObjectNotFound,
    ObjectTooLarge,
    S3Store,
    ServerBusy,
    StoreError,
    StoreUnavailable,
    fetch,
)
from protocol.stores.fetch import MARGIN_S, FetchRequest, FetchTimeout, Got, TooSlow, fetch_many

READ = ReadCredentials(access_key_id="reader", secret_access_key="reader-secret")
BUDGET = 3.0
RATE = 64 * 1024
GRACE = (
    2.0  # an honest loopback GET under the suite's load has this long to start; below the budget
)
LONG_BUDGET = 30.0
"""A budget far past the grace: what cuts a fetch well before it is the rate rule, on a machine
however loaded."""
KEY = "run/w1/update/obj.tsr"
SIZE = 5000
SLOW_MODES = ("drip_headers", "drip_body", "hang")


@pytest.fixture
def honest(s3_server: str, s3_bucket: str, s3_credentials: WriteCredentials) -> Iterator[S3Store]:
    writer = S3Store(s3_bucket, s3_credentials, endpoint=s3_server)
    for i in range(16):
        writer.put(f"honest/{i}.bin", _payload(i))
    reader = S3Store(s3_bucket, READ, endpoint=s3_server)
    yield reader
    reader.close()
    writer.close()


def _payload(i: int) -> bytes:
    return bytes([i]) * (1000 + i)


def _hostile_root(tmp_path: Path, key: str = KEY) -> Path:
    path = tmp_path / "evil" / key
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * SIZE)
    return tmp_path


def _evil(endpoint: str) -> S3Store:
    return S3Store("evil", READ, endpoint=endpoint)


def _timed(requests: dict[Any, FetchRequest], **limits: Any) -> tuple[dict[Any, Any], float]:
    kwargs: dict[str, Any] = {"budget_s": BUDGET, "min_rate_bytes_s": RATE, "grace_s": GRACE}
    t0 = time.monotonic()
    out = fetch_many(requests, **(kwargs | limits))
    return out, time.monotonic() - t0


def _honest_requests(store: S3Store, n: int) -> dict[Any, FetchRequest]:
    return {i: FetchRequest(store, f"honest/{i}.bin", 1 << 20) for i in range(n)}


def _assert_honest(out: dict[Any, Any], n: int) -> None:
    for i in range(n):
        assert isinstance(out[i], Got), out[i]
        assert out[i].data == _payload(i)


def _quoted_md5(data: bytes) -> str:
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


# -- honest objects ------------------------------------------------------------------------------


def test_round_trip_from_s3_and_files(honest: S3Store, tmp_path: Path) -> None:
    files = FileStore(tmp_path / "local")
    for i in range(3):
        files.put(f"a/{i}.bin", b"file %d" % i)
    requests = _honest_requests(honest, 16)
    requests |= {("file", i): FetchRequest(files, f"a/{i}.bin", 100) for i in range(3)}
    requests["s3 missing"] = FetchRequest(honest, "honest/none.bin", 100)
    requests["file missing"] = FetchRequest(files, "a/none.bin", 100)
    requests["s3 capped"] = FetchRequest(honest, "honest/15.bin", 1014)
    requests["file capped"] = FetchRequest(files, "a/0.bin", 5)
    requests["bad key"] = FetchRequest(files, "../etc/passwd", 100)
    out, _ = _timed(requests)
    now = datetime.now(UTC)
    got = [out[i] for i in range(16)] + [out[("file", i)] for i in range(3)]
    for g in got:
        assert isinstance(g, Got)
        assert g.etag == _quoted_md5(g.data)
        assert g.last_modified is not None and g.last_modified.tzinfo is not None
        assert abs(g.last_modified - now) < timedelta(minutes=5)
    _assert_honest(out, 16)
    assert [out[("file", i)].data for i in range(3)] == [b"file 0", b"file 1", b"file 2"]
    assert isinstance(out["s3 missing"], ObjectNotFound)
    assert isinstance(out["file missing"], ObjectNotFound)
    assert isinstance(out["s3 capped"], ObjectTooLarge) and out["s3 capped"].size == 1015
    assert isinstance(out["file capped"], ObjectTooLarge) and out["file capped"].size == 6
    assert isinstance(out["bad key"], InvalidKey)


def _signature_matches(seen: SeenRequest, secret: str, region: str = "us-east-1") -> bool:
    """Check the request's SigV4 signature the way an S3 server does, from what arrived."""
    names = ("host", "x-amz-date", "x-amz-content-sha256")
    request = AWSRequest(
        method=seen.method,
        url=f"http://{seen.headers['host']}{seen.target}",
        headers={name: seen.headers[name] for name in names},
    )
    request.context["timestamp"] = seen.headers["x-amz-date"]
    auth = S3SigV4Auth(Credentials("reader", secret), "s3", region)
    signature = auth.signature(
        auth.string_to_sign(request, auth.canonical_request(request)), request
    )
    return seen.headers["authorization"].endswith(f"Signature={signature}")


def test_one_signed_get_per_object(tmp_path: Path) -> None:
    key = "run/w1/a=b@c,d:e+f~g.bin"  # every character the key rules allow beyond [A-Za-z0-9._-/]
    server = SlowStore(_hostile_root(tmp_path, key), "normal")
    with server as endpoint:
        out, _ = _timed({"k": FetchRequest(_evil(endpoint), key, 1 << 20)})
    got = out["k"]
    assert isinstance(got, Got) and got.data == b"x" * SIZE and got.etag == _quoted_md5(got.data)
    [seen] = server.requests  # one request: no HEAD before the GET, no retry
    assert seen.method == "GET"
    assert seen.target == "/evil/run/w1/a%3Db%40c%2Cd%3Ae%2Bf~g.bin"  # as signed, not re-quoted
    assert seen.headers["accept-encoding"] == "identity"
    assert _signature_matches(seen, READ.secret_access_key)
    assert not _signature_matches(seen, "another-secret")


def test_the_hostile_server_speaks_enough_s3_for_boto3(tmp_path: Path) -> None:
    root = _hostile_root(tmp_path)
    (root / "evil" / "run" / "other.bin").write_bytes(b"o")
    with SlowStore(root, "normal") as endpoint:
        store = _evil(endpoint)  # the ordinary boto3 store: GET, HEAD, ListObjectsV2
        assert store.get(KEY, 1 << 20) == b"x" * SIZE
        assert store.head(KEY).size == SIZE
        assert [info.key for info in store.list("run/")] == ["run/other.bin", KEY]
        assert [info.key for info in store.list("run/w1/")] == [KEY]
        store.close()


# -- the byte cap --------------------------------------------------------------------------------


def test_an_object_over_the_cap_is_refused_before_its_body(tmp_path: Path) -> None:
    with SlowStore(_hostile_root(tmp_path), "drip_body") as endpoint:
        out, took = _timed({"k": FetchRequest(_evil(endpoint), KEY, SIZE - 1)})
    assert isinstance(out["k"], ObjectTooLarge) and out["k"].size == SIZE
    assert took < GRACE  # its body, one byte per second, was never waited for (that ends in
    # TooSlow after the grace)


def test_a_server_cannot_push_more_than_the_cap(tmp_path: Path) -> None:
    root = _hostile_root(tmp_path)

    def fetch(mode: str, cap: int) -> Got | StoreError:
        with SlowStore(root, mode) as endpoint:  # a cap test, not a rate test: a loaded machine
            got = _timed(
                {"k": FetchRequest(_evil(endpoint), KEY, cap)}, budget_s=30.0, grace_s=20.0
            )
            return got[0]["k"]

    # no announced length: the stream is counted and cut at the cap (it sends 4 MiB more)
    too_much = fetch("no_length", 1 << 20)
    assert isinstance(too_much, ObjectTooLarge), too_much
    # an honest-looking length, then 4 MiB more: only the announced bytes are ever taken (aiohttp
    # may also refuse the answer as malformed, depending on how the extra bytes arrive)
    got = fetch("oversize", 1 << 20)
    assert isinstance(got, StoreUnavailable) or (isinstance(got, Got) and got.data == b"x" * SIZE)


# -- hostile endpoints and the budget ------------------------------------------------------------


@pytest.mark.parametrize("mode", SLOW_MODES)
def test_a_slow_endpoint_is_cut_at_the_rate_and_honest_ones_arrive(
    honest: S3Store, tmp_path: Path, mode: str
) -> None:
    with SlowStore(_hostile_root(tmp_path), mode) as endpoint:
        requests = {"evil": FetchRequest(_evil(endpoint), KEY, 1 << 20)}
        out, took = _timed(requests | _honest_requests(honest, 4), budget_s=LONG_BUDGET)
    assert isinstance(out["evil"], TooSlow), out["evil"]
    assert took < LONG_BUDGET / 2  # cut once the grace period is over, long before the budget
    _assert_honest(out, 4)


@pytest.mark.parametrize("mode", SLOW_MODES)
def test_without_a_rate_floor_the_budget_still_holds(
    honest: S3Store, tmp_path: Path, mode: str
) -> None:
    with SlowStore(_hostile_root(tmp_path), mode) as endpoint:
        requests = {"evil": FetchRequest(_evil(endpoint), KEY, 1 << 20)}
        out, took = _timed(requests | _honest_requests(honest, 4), min_rate_bytes_s=0)
    assert isinstance(out["evil"], FetchTimeout), out["evil"]
    assert BUDGET <= took <= BUDGET + MARGIN_S
    _assert_honest(out, 4)


@pytest.mark.parametrize("rate", [RATE, 0])
def test_eight_hung_endpoints_do_not_cost_sixteen_honest_peers(
    honest: S3Store, tmp_path: Path, rate: float
) -> None:
    root = _hostile_root(tmp_path)
    servers = [SlowStore(root, "hang") for _ in range(8)]
    endpoints = [server.__enter__() for server in servers]
    try:
        requests = {
            ("hung", i): FetchRequest(_evil(e), KEY, 1 << 20) for i, e in enumerate(endpoints)
        }
        # twice the usual budget: sixteen honest GETs to moto on a loaded machine
        out, took = _timed(
            requests | _honest_requests(honest, 16), min_rate_bytes_s=rate, budget_s=2 * BUDGET
        )
    finally:
        for server in servers:
            server.__exit__(None, None, None)
    assert took <= 2 * BUDGET + MARGIN_S
    _assert_honest(out, 16)
    expected = TooSlow if rate else FetchTimeout
    assert all(isinstance(out[("hung", i)], expected) for i in range(8))


def test_waiting_for_a_connection_slot_is_not_charged_to_the_rate(tmp_path: Path) -> None:
    (tmp_path / "evil" / "slow.bin").parent.mkdir(parents=True)
    (tmp_path / "evil" / "slow.bin").write_bytes(b"s" * 300)
    # 400 B/s, four times the floor; charged for the 0.5 s it waits for a slot, it would owe 50
    # bytes at its first check and be cut (the server sends what is due at each wake-up, so a
    # loaded machine does not slow it below its rate)
    dripping = SlowStore(tmp_path, "drip_body", drip_s=0.0025)
    with SlowStore(_hostile_root(tmp_path), "hang") as hung, dripping as slow:
        requests: dict[tuple[str, int] | int, FetchRequest] = {
            ("hung", i): FetchRequest(_evil(hung), KEY, 1 << 20) for i in range(2)
        }
        requests |= {i: FetchRequest(_evil(slow), "slow.bin", 1 << 20) for i in range(2)}
        # the hung ones hold both slots for the 0.5 s grace; the others queue behind them
        out, took = _timed(requests, max_connections=2, min_rate_bytes_s=100, grace_s=0.5)
    assert all(isinstance(out[("hung", i)], TooSlow) for i in range(2))
    assert all(isinstance(out[i], Got) and out[i].data == b"s" * 300 for i in range(2)), out
    assert took <= BUDGET + MARGIN_S


def test_a_redirect_is_refused_not_followed(tmp_path: Path) -> None:
    server = SlowStore(_hostile_root(tmp_path), "redirect")
    with server as endpoint:
        out, _ = _timed({"k": FetchRequest(_evil(endpoint), KEY, 1 << 20)})
    assert isinstance(out["k"], StoreError) and "redirect" in str(out["k"])
    assert [seen.target for seen in server.requests] == [f"/evil/{KEY}"]  # never followed


def test_a_busy_answer_is_asked_again_within_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One 503 (a blip at the provider) costs a retry, not the update."""
    root = _hostile_root(tmp_path)
    with SlowStore(root, "busy_once") as endpoint:
        out, took = _timed({"k": FetchRequest(_evil(endpoint), KEY, 1 << 20)})
    assert isinstance(out["k"], Got) and out["k"].data == b"x" * SIZE, out["k"]
    assert took <= BUDGET + MARGIN_S
    # a budget too short for another try (the wait before it longer than the whole budget, so a
    # loaded machine's slow first answer still arrives inside it)
    monkeypatch.setattr(fetch, "RETRY_S", 2 * BUDGET)
    with SlowStore(root, "busy_once") as endpoint:
        out, _ = _timed({"k": FetchRequest(_evil(endpoint), KEY, 1 << 20)})
    assert isinstance(out["k"], ServerBusy), out["k"]


def test_denied_and_unreachable_endpoints_are_typed(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with SlowStore(_hostile_root(tmp_path), "deny") as endpoint:
        requests = {
            "denied": FetchRequest(_evil(endpoint), KEY, 1 << 20),
            "closed": FetchRequest(_evil(closed), KEY, 1 << 20),
        }
        out, took = _timed(requests)
    assert isinstance(out["denied"], AccessDenied)
    assert isinstance(out["closed"], StoreUnavailable)
    assert not isinstance(out["closed"], FetchTimeout | TooSlow)
    assert took < 1.0


def test_a_stuck_name_lookup_does_not_stretch_the_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = socket.getaddrinfo
    release = threading.Event()

    def stuck(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "stuck.invalid":  # a hostile name server that never answers (until released)
            release.wait(10)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    files = FileStore(tmp_path / "local")
    files.put("a.bin", b"ok")
    requests = {
        "stuck": FetchRequest(_evil("http://stuck.invalid:9"), KEY, 1 << 20),
        "file": FetchRequest(files, "a.bin", 100),
    }
    try:
        out, took = _timed(requests, budget_s=1.0, min_rate_bytes_s=0)
    finally:
        release.set()
    assert isinstance(out["stuck"], FetchTimeout)
    assert isinstance(out["file"], Got) and out["file"].data == b"ok"
    assert took <= 1.0 + MARGIN_S


# -- threads -------------------------------------------------------------------------------------


def test_no_thread_outlives_the_call(tmp_path: Path) -> None:
    root = _hostile_root(tmp_path)
    files = FileStore(tmp_path / "local")
    files.put("big.bin", b"b" * (8 << 20))  # several chunks per read
    for i in range(4):
        files.put(f"f/{i}.bin", b"%d" % i)
    with SlowStore(root, "normal") as normal, SlowStore(root, "hang") as hung:
        by_name = _evil(normal.replace("127.0.0.1", "localhost"))  # a name lookup per request
        before = threading.enumerate()
        requests: dict[int | tuple[str, int] | str, FetchRequest] = {
            i: FetchRequest(by_name, KEY, 1 << 20) for i in range(4)
        }
        requests |= {("f", i): FetchRequest(files, f"f/{i}.bin", 100) for i in range(4)}
        requests["big"] = FetchRequest(files, "big.bin", 8 << 20)
        requests["hung"] = FetchRequest(_evil(hung), KEY, 1 << 20)
        # a long budget: on a loaded machine the name lookups and the 8 MiB read need the time
        # (one still in its read when the budget ends is left behind, as it should be); the hung
        # request holds a thread until the budget ends
        out, took = _timed(requests, budget_s=10.0, min_rate_bytes_s=0)
        after = threading.enumerate()
    assert after == before
    assert all(isinstance(out[i], Got) for i in range(4))
    assert all(isinstance(out[("f", i)], Got) for i in range(4))
    assert isinstance(out["big"], Got) and len(out["big"].data) == 8 << 20
    assert isinstance(out["hung"], FetchTimeout)
    assert took <= 10.0 + MARGIN_S


def test_an_abandoned_name_lookup_is_joined_within_the_margin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = socket.getaddrinfo

    def slow(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host == "slow.invalid":  # answers, but only after the budget is spent
            time.sleep(0.15)
            host = "127.0.0.1"
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", slow)
    before = threading.enumerate()
    out, took = _timed({"k": FetchRequest(_evil("http://slow.invalid:9"), KEY, 1)}, budget_s=0.05)
    assert threading.enumerate() == before  # the lookup's thread ended and was joined
    assert isinstance(out["k"], FetchTimeout)
    assert took <= 0.05 + MARGIN_S


# -- arguments -----------------------------------------------------------------------------------


def test_arguments(tmp_path: Path) -> None:
    assert fetch_many({}, budget_s=1.0, min_rate_bytes_s=1.0, grace_s=0.0) == {}
    files = FileStore(tmp_path)
    with pytest.raises(ValueError):
        fetch_many({1: FetchRequest(files, "a", -1)}, budget_s=1, min_rate_bytes_s=1, grace_s=0)
    for bad in ({"budget_s": -1.0}, {"grace_s": float("nan")}, {"max_connections": 0}):
        with pytest.raises(ValueError):
            _timed({1: FetchRequest(files, "a", 1)}, **bad)
    out, took = _timed({1: FetchRequest(files, "a", 1)}, budget_s=0.0)
    assert isinstance(out[1], FetchTimeout) and took < MARGIN_S
