"""`fetch_many` with spool files: bodies go to disk as they arrive, under the same cap, watchdog
and budget; a failed or cut transfer leaves no file; a spool file read back is the bytes written
or a `SpoolError`, never other bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from lab.sim.slow_store import SlowStore
from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import FileStore, ObjectNotFound, ObjectTooLarge, S3Store
from protocol.stores.fetch import FetchRequest, Got, TooSlow, fetch_many
from protocol.stores.spool import InMemory, Spooled, SpoolError

READ = ReadCredentials(access_key_id="reader", secret_access_key="reader-secret")
KEY = "run/w1/update/obj.tsr"
SIZE = 300_000  # several chunks of a response, one of a file read


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _fetch(requests: dict, budget_s: float = 3.0, grace_s: float = 1.0) -> dict:
    return fetch_many(requests, budget_s=budget_s, min_rate_bytes_s=64 * 1024, grace_s=grace_s)


def _served(tmp_path: Path, data: bytes) -> Path:
    root = tmp_path / "served"
    path = root / "evil" / KEY
    path.parent.mkdir(parents=True)
    path.write_bytes(data)
    return root


def test_bodies_are_spooled_as_they_arrive(
    tmp_path: Path, s3_server: str, s3_bucket: str, s3_credentials: WriteCredentials
) -> None:
    payload = os.urandom(SIZE)
    writer = S3Store(s3_bucket, s3_credentials, endpoint=s3_server)
    writer.put(KEY, payload)
    files = FileStore(tmp_path / "files")
    files.put(KEY, payload)
    spool = tmp_path / "spool"
    spool.mkdir()
    stores = {"s3": S3Store(s3_bucket, READ, endpoint=s3_server), "file": files}
    requests = {n: FetchRequest(s, KEY, SIZE, spool / n) for n, s in stores.items()}
    requests["memory"] = FetchRequest(files, KEY, SIZE)
    requests["missing"] = FetchRequest(files, "run/none.bin", SIZE, spool / "missing")
    requests["capped"] = FetchRequest(files, KEY, SIZE - 1, spool / "capped")
    out = _fetch(requests, budget_s=60.0, grace_s=30.0)  # a loaded machine: not a rate test
    for name in ("s3", "file"):
        got = out[name]
        assert isinstance(got, Got) and got.body == Spooled(spool / name, SIZE, _digest(payload))
        assert (spool / name).read_bytes() == payload == got.data
        assert got.etag == f'"{hashlib.md5(payload, usedforsecurity=False).hexdigest()}"'
    assert out["memory"].body == InMemory(payload, _digest(payload))
    assert isinstance(out["missing"], ObjectNotFound)
    assert isinstance(out["capped"], ObjectTooLarge)
    assert sorted(os.listdir(spool)) == ["file", "s3"]  # nothing of the failed ones
    writer.close()


@pytest.mark.parametrize("mode", ["no_length", "drip_body"])
def test_a_refused_or_cut_transfer_leaves_no_spool_file(tmp_path: Path, mode: str) -> None:
    # no_length: 1 MiB arrives and is spooled before the cap cuts it; drip_body: the file is
    # open when the rate watchdog cancels the transfer
    root = _served(tmp_path, b"x" * SIZE)
    spool = tmp_path / "spool"
    spool.mkdir()
    with SlowStore(root, mode) as endpoint:
        store = S3Store("evil", READ, endpoint=endpoint)
        got = _fetch({"k": FetchRequest(store, KEY, 1 << 20, spool / "k")}, budget_s=2.0)["k"]
    expected = {"no_length": ObjectTooLarge, "drip_body": TooSlow}[mode]
    assert isinstance(got, expected), got
    assert os.listdir(spool) == []


def test_a_spool_file_that_changed_or_vanished_is_an_error(tmp_path: Path) -> None:
    files = FileStore(tmp_path / "files")
    payload = os.urandom(SIZE)
    files.put(KEY, payload)
    got = _fetch({"k": FetchRequest(files, KEY, SIZE, tmp_path / "k")})["k"]
    assert isinstance(got, Got) and isinstance(got.body, Spooled)
    path = got.body.path
    flipped = bytearray(payload)
    flipped[SIZE // 2] ^= 1
    for changed in (bytes(flipped), payload[:-1], payload + b"!"):
        path.write_bytes(changed)
        with pytest.raises(SpoolError, match="changed"):
            got.body.read()
    path.write_bytes(payload)
    assert got.body.read() == payload
    path.unlink()
    with pytest.raises(SpoolError, match="gone"):
        got.body.read()


def test_spool_paths_are_new_distinct_and_in_a_directory(tmp_path: Path) -> None:
    files = FileStore(tmp_path / "files")
    (tmp_path / "taken").write_bytes(b"")
    bad = [
        {"a": FetchRequest(files, KEY, 10, tmp_path / "taken")},
        {"a": FetchRequest(files, KEY, 10, tmp_path / "no" / "a")},
        {n: FetchRequest(files, KEY, 10, tmp_path / "same") for n in "ab"},
    ]
    for requests in bad:
        with pytest.raises(ValueError, match="spool"):
            _fetch(requests)


def test_a_spool_file_that_cannot_be_written_is_our_error_not_the_peers(tmp_path: Path) -> None:
    """`SpoolError` is raised, never returned as the peer's `StoreUnavailable`."""
    files = FileStore(tmp_path / "files")
    files.put(KEY, b"body")
    unwritable = tmp_path / ("x" * 300)  # a name the file system refuses (even to root)
    with pytest.raises(SpoolError, match="cannot create"):
        _fetch({"a": FetchRequest(files, KEY, 10, unwritable)})
