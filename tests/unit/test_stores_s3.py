"""S3 store against moto on loopback: multipart, parallel ranged GETs, byte cap, outages."""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.exceptions import ClientError, ConnectionClosedError, ReadTimeoutError
from moto.core import enable_iam_authentication

from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import (
    AccessDenied,
    ObjectTooLarge,
    ReadOnlyStoreError,
    RetryPolicy,
    S3Config,
    S3Store,
    StoreError,
    StoreUnavailable,
    open_store,
)
from protocol.stores.s3_config import MIN_PART_SIZE
from tests.support.servers import (
    TEST_ACCESS_KEY_ID,
    TEST_SECRET,
    start_moto_server,
    stop_moto_server,
)

MIB = 1 << 20
FAST_RETRY = RetryPolicy(attempts=3, base_delay=0.01, max_delay=0.05)


def _config(**overrides: Any) -> S3Config:
    base: dict[str, Any] = {
        "part_size": 8 * MIB,
        "multipart_threshold": 8 * MIB,
        "download_part_size": 1 * MIB,
        "max_concurrency": 4,
        "connect_timeout": 1,
        "read_timeout": 5,
        "botocore_max_attempts": 2,
        "retry": FAST_RETRY,
    }
    base.update(overrides)
    return S3Config(**base)


def _store(url: str, creds: WriteCredentials, **overrides: Any) -> S3Store:
    store = open_store(url, creds, s3_config=_config(**overrides))
    assert isinstance(store, S3Store)
    return store


def _write_pattern(path: Path, mib: int) -> str:
    """A `mib` MiB file: one random MiB repeated, each copy stamped with its index. SHA-256."""
    block = bytearray(os.urandom(MIB))
    digest = hashlib.sha256()
    with path.open("wb") as out:
        for i in range(mib):
            block[:8] = i.to_bytes(8, "little")
            out.write(block)
            digest.update(block)
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(4 * MIB):
            digest.update(chunk)
    return digest.hexdigest()


def _no_leftovers(directory: Path, allowed: set[str]) -> None:
    assert {p.name for p in directory.iterdir()} == allowed


def _lose_first_answer(
    monkeypatch: pytest.MonkeyPatch,
    store: S3Store,
    first: Callable[[Callable, dict], Any],
    later: Callable[[Callable, dict], Any] = lambda real, kwargs: real(**kwargs),
) -> None:
    """The store's first CompleteMultipartUpload is `first(the real call, its arguments)`, and
    its answer is lost (a read timeout); later ones are `later(…)`."""
    real = store._client.complete_multipart_upload
    calls = []

    def complete(**kwargs: Any) -> Any:
        calls.append(kwargs)
        if len(calls) > 1:
            return later(real, kwargs)
        first(real, kwargs)
        raise ReadTimeoutError(endpoint_url="lost")

    monkeypatch.setattr(store._client, "complete_multipart_upload", complete)


def test_a_multipart_upload_completed_with_its_answer_lost_is_recognised_as_ours(
    s3_url: str, s3_credentials: WriteCredentials, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store completed the upload and the answer was lost; asked again, it says the upload is
    gone (AWS: NoSuchUpload). The object under the key carries the ETag of exactly these parts,
    so the upload stands."""
    src = tmp_path / "src.bin"
    expected = _write_pattern(src, 12)
    store = _store(s3_url, s3_credentials, part_size=5 * MIB, multipart_threshold=5 * MIB)

    def gone(real: Callable, kwargs: dict) -> Any:
        error = {"Error": {"Code": "NoSuchUpload", "Message": "completed or aborted"}}
        raise ClientError(error, "CompleteMultipartUpload")

    _lose_first_answer(monkeypatch, store, lambda real, kwargs: real(**kwargs), gone)
    assert store.put_file("ckpt/model.bin", src) == 12 * MIB
    dest = tmp_path / "dest.bin"
    store.get_to_file("ckpt/model.bin", dest, max_bytes=12 * MIB)
    assert _sha256(dest) == expected


def test_an_older_object_of_the_same_size_is_not_taken_for_a_lost_completion(
    s3_url: str, s3_credentials: WriteCredentials, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The upload vanished without completing (aborted elsewhere) while the key holds an older
    object of the very same size: the retried completion fails, as it must."""
    store = _store(s3_url, s3_credentials, part_size=5 * MIB, multipart_threshold=5 * MIB)
    old, new = tmp_path / "old.bin", tmp_path / "new.bin"
    _write_pattern(old, 12)
    _write_pattern(new, 12)
    store.put_file("ckpt/model.bin", old)
    before = store.head("ckpt/model.bin")

    def abort(real: Callable, kwargs: dict) -> None:  # the request never reaches the store
        store._client.abort_multipart_upload(
            Bucket=kwargs["Bucket"], Key=kwargs["Key"], UploadId=kwargs["UploadId"]
        )

    _lose_first_answer(monkeypatch, store, abort)
    with pytest.raises(StoreError):
        store.put_file("ckpt/model.bin", new)
    assert store.head("ckpt/model.bin") == before


def test_multipart_round_trip(
    s3_url: str, s3_credentials: WriteCredentials, tmp_path: Path
) -> None:
    """A file of 13 parts of S3's smallest part size goes up in parts and comes down in ranges,
    byte for byte, leaving nothing behind."""
    size_mib = 13 * MIN_PART_SIZE // MIB
    src = tmp_path / "src.bin"
    expected = _write_pattern(src, size_mib)
    store = _store(
        s3_url, s3_credentials, part_size=MIN_PART_SIZE, multipart_threshold=MIN_PART_SIZE,
        download_part_size=MIN_PART_SIZE, max_concurrency=4,
        read_timeout=60,  # moto joins the parts in one answer: seconds on a loaded machine
    )  # fmt: skip
    started = time.perf_counter()
    assert store.put_file("run/ckpt/model.bin", src) == size_mib * MIB
    up = time.perf_counter() - started
    stats = store.stats.snapshot()
    assert stats["parts_uploaded"] == 13
    assert store.head("run/ckpt/model.bin").size == size_mib * MIB

    dest = tmp_path / "dest.bin"
    started = time.perf_counter()
    assert store.get_to_file("run/ckpt/model.bin", dest, max_bytes=size_mib * MIB) == size_mib * MIB
    down = time.perf_counter() - started
    assert _sha256(dest) == expected
    assert store.stats.snapshot()["range_requests"] >= 13  # a part asked again on a retry
    _no_leftovers(tmp_path, {"src.bin", "dest.bin"})
    print(f"\n{size_mib} MiB over loopback moto: put_file {up:.2f}s, get_to_file {down:.2f}s")


def test_parallel_ranged_download(
    s3_url: str, s3_credentials: WriteCredentials, tmp_path: Path
) -> None:
    data = os.urandom(8 * MIB + 123)
    store = _store(s3_url, s3_credentials, download_part_size=1 * MIB, max_concurrency=4)
    store.put("update.bin", data)  # > threshold: multipart from memory
    assert store.stats.parts_uploaded == 2

    seen_ranges: list[str] = []

    def record(request: Any, **_: Any) -> None:
        if request.headers.get("Range"):
            seen_ranges.append(request.headers["Range"].decode()
                               if isinstance(request.headers["Range"], bytes)
                               else request.headers["Range"])  # fmt: skip

    store._client.meta.events.register("before-send.s3.GetObject", record)
    before = store.stats.snapshot()
    assert store.get("update.bin", max_bytes=len(data)) == data
    after = store.stats.snapshot()
    assert after["range_requests"] - before["range_requests"] == 9  # 8 full MiB + 123 bytes
    assert after["bytes_downloaded"] - before["bytes_downloaded"] == len(data)
    assert sorted(seen_ranges, key=lambda r: int(r[6:].split("-")[0]))[-1] == (
        f"bytes={8 * MIB}-{8 * MIB + 122}"
    )
    assert store.get_to_file("update.bin", tmp_path / "u.bin", len(data)) == len(data)
    assert (tmp_path / "u.bin").read_bytes() == data


def test_cap_checked_before_any_body_byte(
    s3_url: str, s3_credentials: WriteCredentials, tmp_path: Path
) -> None:
    store = _store(s3_url, s3_credentials)
    store.put("huge.bin", os.urandom(3 * MIB))
    before = store.stats.snapshot()
    dest = tmp_path / "huge.bin"
    with pytest.raises(ObjectTooLarge) as info:
        store.get_to_file("huge.bin", dest, max_bytes=2 * MIB)
    assert info.value.size == 3 * MIB
    with pytest.raises(ObjectTooLarge):
        store.get("huge.bin", max_bytes=MIB)
    after = store.stats.snapshot()
    assert after["bytes_downloaded"] == before["bytes_downloaded"]  # not one body byte read
    assert after["http_attempts"] - before["http_attempts"] == 2  # one ranged GET each
    _no_leftovers(tmp_path, set())


def test_small_cap_requests_at_most_cap_plus_one(
    s3_url: str, s3_credentials: WriteCredentials
) -> None:
    store = _store(s3_url, s3_credentials)
    store.put("manifest.json", b"{}" * 1000)
    ranges: list[Any] = []
    store._client.meta.events.register(
        "before-send.s3.GetObject", lambda request, **_: ranges.append(request.headers["Range"])
    )
    with pytest.raises(ObjectTooLarge):
        store.get("manifest.json", max_bytes=100)
    assert ranges == [b"bytes=0-100"] or ranges == ["bytes=0-100"]


def test_object_replaced_during_download_restarts(
    s3_url: str, s3_credentials: WriteCredentials, s3_bucket: str, s3_server: str
) -> None:
    store = _store(s3_url, s3_credentials, download_part_size=1 * MIB, max_concurrency=2)
    old, new = os.urandom(4 * MIB), os.urandom(5 * MIB)
    store.put("moving.bin", old)
    writer = boto3.client(
        "s3", endpoint_url=s3_server, region_name="us-east-1",
        aws_access_key_id=TEST_ACCESS_KEY_ID, aws_secret_access_key=TEST_SECRET,
    )  # fmt: skip
    calls = {"n": 0}

    def replace_after_first_get(**_: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            writer.put_object(Bucket=s3_bucket, Key="moving.bin", Body=new)

    store._client.meta.events.register("after-call.s3.GetObject", replace_after_first_get)
    assert store.get("moving.bin", max_bytes=8 * MIB) == new  # never a mix of old and new
    # 1 first GET + at least 1 ranged GET refused by If-Match, then 5 GETs of the new object
    assert calls["n"] >= 7
    writer.close()


def test_read_only_store_refuses_writes_without_a_request(
    s3_url: str, s3_credentials: WriteCredentials, tmp_path: Path
) -> None:
    writer = _store(s3_url, s3_credentials)
    writer.put("k", b"v")
    reader = open_store(
        s3_url, ReadCredentials(access_key_id="reader", secret_access_key="r"), s3_config=_config()
    )
    assert isinstance(reader, S3Store)
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(ReadOnlyStoreError):
        reader.put("k", b"overwrite")
    with pytest.raises(ReadOnlyStoreError):
        reader.put_file("k", tmp_path / "f")
    with pytest.raises(ReadOnlyStoreError):
        reader.delete("k")
    assert reader.stats.http_attempts == 0
    assert reader.get("k", 10) == b"v"


def test_bad_credentials_give_a_helpful_access_denied(s3_url: str, s3_bucket: str) -> None:
    secret = "do-not-print-this-secret"
    store = open_store(
        s3_url,
        ReadCredentials(access_key_id="AKIAEXAMPLEEXAMPLE99", secret_access_key=secret),
        s3_config=_config(),
    )
    with enable_iam_authentication():
        for call in (lambda: store.get("k", 10), lambda: store.head("k"), lambda: store.list()):
            with pytest.raises(AccessDenied) as info:
                call()
            message = str(info.value)
            assert s3_bucket in message and "127.0.0.1" in message
            assert "check" in message and "AKIA…LE99" in message
            assert secret not in message and secret not in repr(info.value.__cause__)


def test_failed_multipart_upload_is_aborted(
    s3_url: str, s3_credentials: WriteCredentials, s3_bucket: str, s3_server: str
) -> None:
    store = _store(s3_url, s3_credentials, part_size=5 * MIB, multipart_threshold=5 * MIB)

    def break_part_three(params: dict[str, Any], **_: Any) -> None:
        if params.get("PartNumber") == 3:
            raise ConnectionClosedError(endpoint_url=s3_server)

    store._client.meta.events.register("before-parameter-build.s3.UploadPart", break_part_three)
    with pytest.raises(StoreUnavailable):
        store.put("half.bin", os.urandom(16 * MIB))
    assert store.stats.multipart_aborts == 1
    assert store.stats.retries >= FAST_RETRY.attempts - 1
    admin = store._client
    assert admin.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", []) == []
    assert not store.exists("half.bin")


def test_server_gone_before_download(s3_credentials: WriteCredentials, tmp_path: Path) -> None:
    server, endpoint = start_moto_server()
    url = f"s3://outage-before?endpoint={endpoint}"
    store = _store(url, s3_credentials)
    store._client.create_bucket(Bucket="outage-before")
    store.put("u.bin", os.urandom(3 * MIB))
    stop_moto_server(server)

    before = store.stats.snapshot()
    started = time.perf_counter()
    dest = tmp_path / "u.bin"
    with pytest.raises(StoreUnavailable) as info:
        store.get_to_file("u.bin", dest, max_bytes=4 * MIB)
    elapsed = time.perf_counter() - started
    after = store.stats.snapshot()
    assert after["retries"] - before["retries"] == FAST_RETRY.attempts - 1
    # botocore retried every one of our attempts too
    assert after["http_attempts"] - before["http_attempts"] == FAST_RETRY.attempts * 2
    assert "after 3 attempt" in str(info.value) and "u.bin" in str(info.value)
    _no_leftovers(tmp_path, set())
    assert elapsed < 15


class CuttableProxy:
    """Loopback TCP proxy that severs every connection, and refuses new ones, once `cut_after`
    bytes have gone from the server to the client; then calls `on_cut`."""

    def __init__(self, target_port: int, cut_after: int, on_cut: Callable[[], None]) -> None:
        self._target = target_port
        self._cut_after = cut_after
        self._on_cut = on_cut
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self.downstream = 0
        self.cut = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.cut.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self._target))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self.cut.is_set():  # severed meanwhile: refuse this one too
                    client.close()
                    upstream.close()
                    return
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while data := src.recv(65536):
                if downstream:
                    with self._lock:
                        self.downstream += len(data)
                        over = self.downstream > self._cut_after
                    if over:
                        self.sever()
                        return
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def sever(self) -> None:
        with self._lock:
            if self.cut.is_set():
                return
            self.cut.set()
            sockets = list(self._sockets)
        self._listener.close()
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self._on_cut()


def test_server_gone_mid_download(s3_credentials: WriteCredentials, tmp_path: Path) -> None:
    server, endpoint = start_moto_server()
    port = int(endpoint.rsplit(":", 1)[1])
    direct = _store(f"s3://outage-mid?endpoint={endpoint}", s3_credentials)
    direct._client.create_bucket(Bucket="outage-mid")
    direct.put("big.bin", os.urandom(24 * MIB))

    stopped = threading.Event()

    def stop_server() -> None:
        stop_moto_server(server)
        stopped.set()

    proxy = CuttableProxy(port, cut_after=6 * MIB, on_cut=stop_server)
    store = _store(
        f"s3://outage-mid?endpoint=http://127.0.0.1:{proxy.port}",
        s3_credentials,
        download_part_size=2 * MIB,
        max_concurrency=3,
    )
    dest = tmp_path / "big.bin"
    with pytest.raises(StoreUnavailable):
        store.get_to_file("big.bin", dest, max_bytes=32 * MIB)
    stats = store.stats.snapshot()
    assert proxy.cut.is_set() and stopped.wait(5)
    assert 0 < stats["bytes_downloaded"] < 24 * MIB  # it was cut mid-transfer
    assert stats["retries"] >= FAST_RETRY.attempts - 1
    _no_leftovers(tmp_path, set())


def test_list_follows_pagination(s3_url: str, s3_credentials: WriteCredentials) -> None:
    store = _store(s3_url, s3_credentials, list_page_size=2)
    keys = [f"w/{i:02d}" for i in range(7)]
    for key in reversed(keys):
        store.put(key, key.encode())
    store.put("other", b"x")
    before = store.stats.http_attempts
    assert [info.key for info in store.list("w/")] == keys
    assert store.stats.http_attempts - before == 4  # pages of 2, 2, 2, 1


def test_multipart_parts_stay_within_s3s_count_and_every_part_but_the_last_shares_one_size() -> (
    None
):
    from protocol.stores.s3_config import MIB, S3Config

    cfg = S3Config()
    for size in (
        1,
        40 * MIB,
        10_000 * cfg.part_size,
        10_000 * cfg.part_size + 1,
        200 << 30,
        5 << 40,
    ):
        part = cfg.upload_part_size(size)
        assert part % MIB == 0 and part >= cfg.part_size
        assert -(-size // part) <= 10_000  # S3 refuses an upload of more parts
        smaller = part - MIB  # the smallest size that does: fewer requests are not bought dearer
        assert smaller < cfg.part_size or -(-size // smaller) > 10_000
    with pytest.raises(StoreError, match="5 TiB"):
        cfg.upload_part_size((5 << 40) + 1)
