"""`fetch_many` against a real S3 server (moto) and hostile endpoints on loopback.

A gather never runs past its budget plus `MARGIN_S`, whatever an endpoint does; honest objects in
the same call all arrive; no thread outlives the call (moto's own per-request threads aside).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.sim.slow_store import SlowStore
from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import ObjectNotFound, ObjectTooLarge, S3Store, StoreError, open_store
from protocol.stores.fetch import MARGIN_S, FetchRequest, FetchTimeout, Got, TooSlow, fetch_many

READ = ReadCredentials(access_key_id="reader", secret_access_key="reader-secret")
BUDGET = 3.0
KEY = "run/w1/update/obj.tsr"


@pytest.fixture
def honest(s3_server: str, s3_bucket: str, s3_credentials: WriteCredentials) -> Iterator[S3Store]:
    writer = S3Store(s3_bucket, s3_credentials, endpoint=s3_server)
    for i in range(16):
        writer.put(f"honest/{i}.bin", bytes([i]) * (1000 + i))
    yield S3Store(s3_bucket, READ, endpoint=s3_server)
    writer.close()


def _hostile_root(tmp_path: Path) -> Path:
    (tmp_path / "evil" / "run" / "w1" / "update").mkdir(parents=True)
    (tmp_path / "evil" / KEY).write_bytes(b"x" * 5000)
    return tmp_path


def _timed(requests: dict, budget: float = BUDGET) -> tuple[dict, float]:
    t0 = time.monotonic()
    out = fetch_many(requests, budget_s=budget, min_rate_bytes_s=64 * 1024, grace_s=1.0)
    return out, time.monotonic() - t0


def test_round_trip_from_s3_and_files(honest: S3Store, tmp_path: Path) -> None:
    files = open_store(f"file://{tmp_path}?bucket=local")
    files.put("a/b.bin", b"hello")
    requests = {i: FetchRequest(honest, f"honest/{i}.bin", 1 << 20) for i in range(16)}
    requests["file"] = FetchRequest(files, "a/b.bin", 100)
    requests["missing"] = FetchRequest(honest, "honest/none.bin", 100)
    requests["capped"] = FetchRequest(honest, "honest/15.bin", 100)
    out, _ = _timed(requests)
    for i in range(16):
        got = out[i]
        assert isinstance(got, Got) and got.data == bytes([i]) * (1000 + i)
        assert got.etag and got.last_modified is not None
    assert isinstance(out["file"], Got) and out["file"].data == b"hello"
    assert isinstance(out["missing"], ObjectNotFound)
    assert isinstance(out["capped"], ObjectTooLarge)


@pytest.mark.parametrize(
    "mode,error",
    [
        ("drip_headers", TooSlow),
        ("drip_body", TooSlow),
        ("hang", TooSlow),
        ("redirect", StoreError),
    ],
)
def test_a_hostile_endpoint_costs_at_most_the_budget(
    honest: S3Store, tmp_path: Path, mode: str, error: type
) -> None:
    before = set(threading.enumerate())
    with SlowStore(_hostile_root(tmp_path), mode) as endpoint:
        evil = S3Store("evil", READ, endpoint=endpoint)
        requests: dict = {"evil": FetchRequest(evil, KEY, 1 << 20)}
        requests |= {i: FetchRequest(honest, f"honest/{i}.bin", 1 << 20) for i in range(4)}
        server_threads = set(threading.enumerate()) - before
        out, took = _timed(requests)
        assert took <= BUDGET + MARGIN_S
        assert isinstance(out["evil"], error), out["evil"]
        if mode == "redirect":  # refused as a redirect, never followed
            assert "redirect" in str(out["evil"])
        assert all(isinstance(out[i], Got) for i in range(4))
        leaked = set(threading.enumerate()) - before - server_threads
        assert not [t for t in leaked if t.is_alive() and "process_request" not in t.name]


def test_without_a_rate_floor_the_budget_still_holds(tmp_path: Path) -> None:
    with SlowStore(_hostile_root(tmp_path), "drip_body") as endpoint:
        evil = S3Store("evil", READ, endpoint=endpoint)
        t0 = time.monotonic()
        out = fetch_many(
            {"evil": FetchRequest(evil, KEY, 1 << 20)},
            budget_s=2.0, min_rate_bytes_s=1e-9, grace_s=0.0,
        )  # fmt: skip
        assert time.monotonic() - t0 <= 2.0 + MARGIN_S
        assert isinstance(out["evil"], FetchTimeout)


def test_a_server_cannot_push_more_than_the_cap(tmp_path: Path) -> None:
    root = _hostile_root(tmp_path)

    def fetch(mode: str, cap: int) -> Got | StoreError:
        with SlowStore(root, mode) as endpoint:
            evil = S3Store("evil", READ, endpoint=endpoint)
            return _timed({"evil": FetchRequest(evil, KEY, cap)})[0]["evil"]

    # an announced length above the cap is refused before the (1 byte/s) body is read
    assert isinstance(fetch("drip_body", 4000), ObjectTooLarge)
    # with no announced length, the body is counted while it streams
    assert isinstance(fetch("no_length", 1 << 20), ObjectTooLarge)
    # more bytes than announced are never taken as data
    got = fetch("oversize", 1 << 20)
    assert isinstance(got, StoreError) or (isinstance(got, Got) and len(got.data) == 5000)


def test_eight_hung_endpoints_do_not_cost_sixteen_honest_peers(
    honest: S3Store, tmp_path: Path
) -> None:
    with SlowStore(_hostile_root(tmp_path), "hang") as endpoint:
        hung = [S3Store("evil", READ, endpoint=endpoint) for _ in range(8)]
        requests: dict = {("hung", i): FetchRequest(s, KEY, 1 << 20) for i, s in enumerate(hung)}
        requests |= {i: FetchRequest(honest, f"honest/{i}.bin", 1 << 20) for i in range(16)}
        out, took = _timed(requests)
    assert took <= BUDGET + MARGIN_S
    assert all(isinstance(out[i], Got) for i in range(16))
    assert all(isinstance(out[("hung", i)], StoreError) for i in range(8))
