"""The simulation's faulty provider (`lab.sim.flaky_s3`, `tessera sim --faults store-errors`):
S3 behind a proxy that answers 503 to first tries, loses the answers of writes it stored and
throttles writes. A real `S3Store` on moto rides all of it out, and the read key stays unable
to write through the proxy."""

from __future__ import annotations

import os

import pytest

from lab.sim.flaky_s3 import FlakyS3, scheduled
from node.runtime.read_key import ReadKeyCanWrite, require_read_only
from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import open_store


@pytest.fixture
def private_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_ALLOW_PRIVATE_ENDPOINTS", "1")


def test_a_store_rides_out_every_injected_fault(
    s3_server: str, s3_bucket: str, s3_credentials: WriteCredentials, private_endpoints: None
) -> None:
    wanted = {"503": 3, "lost answer": 3, "throttled": 3}
    keys = []  # objects whose first write gets each fault, by the proxy's schedule
    for i in range(10_000):
        fault = scheduled("PUT", f"PUT /{s3_bucket}/w/{i}.bin")
        if fault is not None and wanted[fault] > 0:
            wanted[fault] -= 1
            keys.append(f"w/{i}.bin")
    assert not any(wanted.values())
    flaky = FlakyS3(s3_server, "reader", throttle_s=0.2)
    with flaky as endpoint:
        store = open_store(f"s3://{s3_bucket}?endpoint={endpoint}", s3_credentials)
        blobs = {key: os.urandom(100 + i) for i, key in enumerate(keys)}
        for key, data in blobs.items():
            store.put(key, data)
        assert {key: store.get(key, 1 << 20) for key in blobs} == blobs
        assert sorted(o.key for o in store.list("w/")) == sorted(blobs)
        assert {key: store.head(key).size for key in blobs} == {k: len(v) for k, v in blobs.items()}
    assert flaky.faults["503"] >= 3 and flaky.faults["lost answer"] == 3
    assert flaky.faults["throttled"] == 3


def test_the_read_key_cannot_write_through_the_proxy(
    s3_server: str, s3_bucket: str, s3_credentials: WriteCredentials, private_endpoints: None
) -> None:
    read = ReadCredentials(access_key_id="reader", secret_access_key="reader-secret")
    with FlakyS3(s3_server, "reader") as endpoint:
        url = f"s3://{s3_bucket}?endpoint={endpoint}"
        require_read_only(
            url, open_store(url, s3_credentials), read
        )  # refused: the key may be published
    with FlakyS3(s3_server, None) as endpoint:  # moto alone lets any key write
        url = f"s3://{s3_bucket}?endpoint={endpoint}"
        with pytest.raises(ReadKeyCanWrite):
            require_read_only(url, open_store(url, s3_credentials), read)


def test_signed_requests_pass_the_proxy_unchanged(
    s3_server: str, s3_bucket: str, enforced_iam: None, private_endpoints: None
) -> None:
    """A server that checks signatures answers the proxy's requests as it would the store's: a
    list whose prefix ends in ``/`` (sent as ``%2F``, signed as sent) included."""
    from moto.core.authorization import disable_iam_authentication

    from tests.support.servers import iam_user

    with disable_iam_authentication():
        key_id, secret = iam_user(s3_server, s3_bucket, ["s3:*"])
    keys = WriteCredentials(access_key_id=key_id, secret_access_key=secret)
    with FlakyS3(s3_server, None) as endpoint:
        store = open_store(f"s3://{s3_bucket}?endpoint={endpoint}", keys)
        for key in ("run/a/1.bin", "run/a/2.bin", "run/b.bin"):
            store.put(key, key.encode())
        assert sorted(o.key for o in store.list("run/a/")) == ["run/a/1.bin", "run/a/2.bin"]
        assert store.get("run/b.bin", 100) == b"run/b.bin"
