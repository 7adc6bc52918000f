"""One contract for every object store backend: file:// and s3:// (moto on loopback)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from protocol.credentials import ReadCredentials, WriteCredentials
from protocol.stores import (
    DEFAULT_LIST_LIMIT,
    InvalidKey,
    ListingTooLarge,
    ObjectExists,
    ObjectNotFound,
    ObjectStore,
    ObjectTooLarge,
    ReadableStore,
    ReadOnlyStoreError,
    RetryPolicy,
    S3Config,
    open_store,
)

# Small parts, so that objects of a few hundred KiB already take the parallel ranged path.
FAST_S3 = S3Config(
    part_size=5 << 20,
    multipart_threshold=5 << 20,
    download_part_size=64 << 10,
    max_concurrency=4,
    connect_timeout=2,
    read_timeout=10,
    botocore_max_attempts=2,
    retry=RetryPolicy(attempts=2, base_delay=0.01, max_delay=0.05),
)
READ_KEYS = ReadCredentials(access_key_id="tessera-test-key", secret_access_key="read-secret")

BAD_KEYS: list[object] = [
    "",
    "/abs",
    "trailing/",
    "double//slash",
    "..",
    "../escape",
    "a/../../escape",
    ".",
    "a/./b",
    "back\\slash",
    "space here",
    "nul\x00byte",
    "new\nline",
    "ünicode",
    "a?query",
    "a#frag",
    "%2e%2e",
    ".tessera-tmp-abc",
    "dir/.tessera-tmp-abc",
    "x" * 1025,
    "a/" + "y" * 256,
    None,
    b"bytes-key",
]


@pytest.fixture(params=["file", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/root?bucket=contract"
    return str(request.getfixturevalue("s3_url"))


@pytest.fixture
def store(store_url: str, s3_credentials_or_none: WriteCredentials | None) -> Iterator[ObjectStore]:
    with open_store(store_url, s3_credentials_or_none, s3_config=FAST_S3) as opened:
        yield opened


@pytest.fixture
def s3_credentials_or_none(
    store_url: str, request: pytest.FixtureRequest
) -> WriteCredentials | None:
    if store_url.startswith("s3://"):
        return request.getfixturevalue("s3_credentials")
    return None


def _payload(size: int, seed: int = 1) -> bytes:
    block = bytes((i * 131 + seed * 17) % 251 for i in range(4096))
    return (block * (size // len(block) + 1))[:size]


def test_put_get_round_trip(store: ObjectStore) -> None:
    store.put("w/1/peer-7.bin", b"hello")
    assert store.get("w/1/peer-7.bin", max_bytes=5) == b"hello"
    store.put("view", memoryview(b"from a view"))
    store.put("array", bytearray(b"from an array"))
    assert store.get("view", 100) == b"from a view"
    assert store.get("array", 100) == b"from an array"


def test_overwrite_replaces_whole_object(store: ObjectStore) -> None:
    store.put("k", _payload(300_000, seed=1))
    store.put("k", b"short")
    assert store.get("k", 1 << 20) == b"short"
    assert store.head("k").size == 5


def test_put_new_never_replaces_or_redates_a_stored_object(store: ObjectStore) -> None:
    """A create-only write stores a free key once; a second one (a retry after a lost answer,
    or other bytes) is refused and leaves the first object, and its time, as they were."""
    store.put_new("once", b"first")
    stamp = store.head("once").last_modified
    for again in (b"first", b"other bytes"):
        with pytest.raises(ObjectExists):
            store.put_new("once", again)
    assert store.get("once", 100) == b"first"
    assert store.head("once").last_modified == stamp
    store.put("once", b"replaced")  # a plain put still replaces
    assert store.get("once", 100) == b"replaced"


def test_multi_part_sized_object(store: ObjectStore) -> None:
    data = _payload(300_001)  # > 4 download parts of 64 KiB on s3
    store.put("bigger.bin", data)
    assert store.get("bigger.bin", len(data)) == data


def test_empty_object(store: ObjectStore, tmp_path: Path) -> None:
    store.put("empty", b"")
    assert store.get("empty", 0) == b""
    assert store.head("empty").size == 0
    assert store.get_to_file("empty", tmp_path / "empty.out", 0) == 0
    assert (tmp_path / "empty.out").read_bytes() == b""


def test_head_and_last_modified_sane(store: ObjectStore) -> None:
    before = datetime.now(UTC) - timedelta(seconds=5)
    store.put("a/b", b"x" * 1234)
    after = datetime.now(UTC) + timedelta(seconds=5)
    info = store.head("a/b")
    assert info.key == "a/b"
    assert info.size == 1234
    assert info.last_modified.tzinfo is not None
    assert info.last_modified.utcoffset() == timedelta(0)
    assert before <= info.last_modified <= after
    assert store.exists("a/b")
    assert not store.exists("a/c")


def test_not_found(store: ObjectStore, tmp_path: Path) -> None:
    with pytest.raises(ObjectNotFound):
        store.get("missing", 10)
    with pytest.raises(ObjectNotFound):
        store.head("missing")
    dest = tmp_path / "out.bin"
    with pytest.raises(ObjectNotFound):
        store.get_to_file("missing", dest, 10)
    assert not dest.exists()
    assert _leftovers(tmp_path) == []


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith(".tessera-tmp-"))


def test_byte_cap(store: ObjectStore, tmp_path: Path) -> None:
    data = _payload(200_000)
    store.put("capped", data)
    assert store.get("capped", max_bytes=200_000) == data
    with pytest.raises(ObjectTooLarge) as info:
        store.get("capped", max_bytes=199_999)
    assert info.value.size == 200_000
    with pytest.raises(ObjectTooLarge):
        store.get("capped", max_bytes=0)
    dest = tmp_path / "capped.out"
    dest.write_bytes(b"previous content")
    with pytest.raises(ObjectTooLarge):
        store.get_to_file("capped", dest, max_bytes=1000)
    assert dest.read_bytes() == b"previous content"  # untouched on failure
    assert _leftovers(tmp_path) == []
    with pytest.raises(ValueError):
        store.get("capped", max_bytes=-1)


def test_get_to_file_and_put_file(store: ObjectStore, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    data = _payload(500_000, seed=3)
    src.write_bytes(data)
    assert store.put_file("files/src.bin", src) == len(data)
    dest = tmp_path / "dest.bin"
    assert store.get_to_file("files/src.bin", dest, max_bytes=len(data)) == len(data)
    assert dest.read_bytes() == data
    assert _leftovers(tmp_path) == []


def test_list(store: ObjectStore) -> None:
    assert store.list() == []
    for key in ["w/10/b", "w/10/a", "w/1/a", "w/2", "x", "w/100/z"]:
        store.put(key, key.encode())
    assert [i.key for i in store.list()] == ["w/1/a", "w/10/a", "w/10/b", "w/100/z", "w/2", "x"]
    assert [i.key for i in store.list("w/1")] == ["w/1/a", "w/10/a", "w/10/b", "w/100/z"]
    assert [i.key for i in store.list("w/1/")] == ["w/1/a"]
    assert [i.key for i in store.list("w/10/")] == ["w/10/a", "w/10/b"]
    assert store.list("nothing/") == []
    sizes = {i.key: i.size for i in store.list("w/")}
    assert sizes["w/10/b"] == len(b"w/10/b")
    assert all(i.last_modified.utcoffset() == timedelta(0) for i in store.list())
    with pytest.raises(ListingTooLarge):
        store.list("w/", limit=3)
    assert len(store.list("w/", limit=5)) == 5
    assert DEFAULT_LIST_LIMIT >= 10_000


def test_delete_is_idempotent(store: ObjectStore) -> None:
    store.put("gone/soon", b"1")
    store.delete("gone/soon")
    assert not store.exists("gone/soon")
    store.delete("gone/soon")
    store.delete("never/existed")
    assert store.list("gone/") == []


@pytest.mark.parametrize("key", BAD_KEYS, ids=lambda k: repr(k)[:30])
def test_bad_keys_rejected(store: ObjectStore, key: object, tmp_path: Path) -> None:
    for call in (
        lambda: store.put(key, b"x"),  # type: ignore[arg-type]
        lambda: store.get(key, 10),  # type: ignore[arg-type]
        lambda: store.head(key),  # type: ignore[arg-type]
        lambda: store.delete(key),  # type: ignore[arg-type]
        lambda: store.get_to_file(key, tmp_path / "o", 10),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidKey):
            call()
    assert store.list() == []
    assert not (tmp_path / "o").exists()


def test_good_keys_accepted(store: ObjectStore) -> None:
    keys = ["a", "a.b-c_d=e+f,g@h~i:j", "deep/er/and/deeper/k", "x" * 255, "/".join(["s"] * 500)]
    for key in keys:
        store.put(key, key.encode()[:10])
    assert {i.key for i in store.list()} == set(keys)


def test_bad_prefixes_rejected(store: ObjectStore) -> None:
    for prefix in ["/", "../", "a//", "a/../", "spa ce", "x" * 1025]:
        with pytest.raises(InvalidKey):
            store.list(prefix)


def test_read_credentials_make_a_read_only_store(
    store: ObjectStore, store_url: str, tmp_path: Path
) -> None:
    store.put("published", b"update")
    reader: ReadableStore = open_store(store_url, READ_KEYS, s3_config=FAST_S3)
    assert reader.read_only and not store.read_only
    assert reader.get("published", 100) == b"update"
    assert [i.key for i in reader.list()] == ["published"]
    src = tmp_path / "f"
    src.write_bytes(b"1")
    # `reader` is a ReadableStore: a type checker rejects these calls (hence the ignores), and
    # at run time they raise before any request.
    writes: list[Callable[[], object]] = [
        lambda: reader.put("published", b"overwrite"),  # type: ignore[attr-defined]
        lambda: reader.put_file("other", src),  # type: ignore[attr-defined]
        lambda: reader.delete("published"),  # type: ignore[attr-defined]
    ]
    for call in writes:
        with pytest.raises(ReadOnlyStoreError):
            call()
    assert store.get("published", 100) == b"update"
    assert "read-only" in repr(reader)
    reader.close()


def test_repr_and_errors_carry_no_secret(store: ObjectStore) -> None:
    text = repr(store) + store.location
    with pytest.raises(ObjectNotFound) as info:
        store.get("missing", 1)
    text += str(info.value)
    assert "tessera-test-secret" not in text
    assert os.environ.get("AWS_SECRET_ACCESS_KEY", "\x00") not in text
