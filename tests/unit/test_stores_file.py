"""file:// store specifics: layout, atomicity, and many processes on the same keys."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from protocol.stores import FileStore, ObjectStore, StoreError, open_store

KEYS = [f"shared/obj-{i}" for i in range(4)]
WRITES_EACH = 30  # operations per writer process (a count, not a time: a loaded machine is slower)
READS_EACH = 40


def _framed(rng: random.Random) -> bytes:
    """A self-checking payload: SHA-256 of the body, then a body of 1 B .. 1.5 MiB."""
    body = rng.randbytes(rng.choice([1, 1000, 64 << 10, 700 << 10, 1536 << 10]))
    return hashlib.sha256(body).digest() + body


def _intact(blob: bytes) -> bool:
    return len(blob) > 32 and hashlib.sha256(blob[32:]).digest() == blob[:32]


def _writer(url: str, seed: int, start: Any, results: Any) -> None:
    store = open_store(url)
    rng = random.Random(seed)
    writes = 0
    start.wait(timeout=60)  # all processes begin together, however slow their start-up was
    for _ in range(WRITES_EACH):
        key = rng.choice(KEYS)
        if rng.random() < 0.1:
            store.delete(key)
        else:
            store.put(key, _framed(rng))
        writes += 1
    results.put(("writer", writes))


def _reader(url: str, seed: int, start: Any, results: Any, scratch: str) -> None:
    """Reports (objects read intact, corrupt or partial objects seen, misses)."""
    store = open_store(url)
    rng = random.Random(seed)
    good = bad = missing = 0
    start.wait(timeout=60)
    for _ in range(READS_EACH):
        key = rng.choice(KEYS)
        try:
            if rng.random() < 0.3:
                dest = Path(scratch) / f"r{seed}.bin"
                store.get_to_file(key, dest, max_bytes=2 << 20)
                blob = dest.read_bytes()
            else:
                blob = store.get(key, max_bytes=2 << 20)
        except StoreError:  # deleted meanwhile (ObjectNotFound)
            missing += 1
            continue
        if _intact(blob):
            good += 1
        else:
            bad += 1
        for info in store.list("shared/"):
            if info.key not in KEYS:
                bad += 1  # a temporary file leaked into the listing
    results.put(("reader", (good, bad, missing)))


def test_many_processes_never_see_a_partial_object(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/root?bucket=shared-bucket"
    seeder = open_store(url)
    rng = random.Random(0)
    for key in KEYS:
        seeder.put(key, _framed(rng))
    ctx = multiprocessing.get_context("spawn")  # no fork of a process running server threads
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    start, queue = ctx.Barrier(6), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(url, s, start, queue)) for s in range(3)]
    procs += [
        ctx.Process(target=_reader, args=(url, 100 + s, start, queue, str(scratch)))
        for s in range(3)
    ]
    for proc in procs:
        proc.start()
    reports = [queue.get(timeout=90) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    writes = sum(n for role, n in reports if role == "writer")
    results = [r for role, r in reports if role == "reader"]
    good = sum(r[0] for r in results)
    bad = sum(r[1] for r in results)
    assert bad == 0
    assert writes > 50 and good > 50, (writes, results)
    print(f"\n{writes} writes, reads (intact, corrupt, missing): {results}")
    leftovers = [p for p in (tmp_path / "root").rglob("*") if ".tessera-tmp-" in p.name]
    assert leftovers == []


def test_url_forms_name_the_same_directory(tmp_path: Path) -> None:
    a = open_store(f"file://{tmp_path}?bucket=my-bucket")
    b = open_store(f"file://{tmp_path}/my-bucket")
    assert isinstance(a, FileStore) and isinstance(b, FileStore)
    assert a.directory == b.directory == tmp_path / "my-bucket"
    a.put("x/y", b"1")
    assert b.get("x/y", 1) == b"1"
    assert (tmp_path / "my-bucket" / "x" / "y").read_bytes() == b"1"


def test_bucket_directory_created_on_first_write(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}/deep/er?bucket=bk1")
    assert store.list() == []
    assert not store.exists("k")
    store.put("k", b"v")
    assert (tmp_path / "deep" / "er" / "bk1" / "k").is_file()


def test_last_modified_is_file_mtime_in_utc(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}?bucket=bk1")
    store.put("k", b"v")
    stamp = datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC).timestamp()
    os.utime(tmp_path / "bk1" / "k", (stamp, stamp))
    info = store.head("k")
    assert info.last_modified == datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert store.list()[0].last_modified == info.last_modified


def test_foreign_and_temporary_files_are_not_objects(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}?bucket=bk1")
    store.put("w/1", b"a")
    bucket = tmp_path / "bk1"
    (bucket / "w" / ".tessera-tmp-deadbeef").write_bytes(b"half-written")
    (bucket / "w" / "bad name").write_bytes(b"not a valid key")
    (bucket / "w" / "dir").mkdir()
    os.symlink(bucket / "w" / "1", bucket / "w" / "link")
    assert [i.key for i in store.list()] == ["w/1"]
    with pytest.raises(StoreError):
        store.get("w/dir", 10)


def test_key_that_is_also_a_prefix_is_refused(tmp_path: Path) -> None:
    store: ObjectStore = open_store(f"file://{tmp_path}?bucket=bk1")
    store.put("a", b"1")
    with pytest.raises(StoreError):
        store.put("a/b", b"2")
    store.put("c/d", b"3")
    with pytest.raises(StoreError):
        store.put("c", b"4")
    assert store.get("a", 1) == b"1" and store.get("c/d", 1) == b"3"


def test_failed_download_leaves_destination_untouched(tmp_path: Path) -> None:
    store = open_store(f"file://{tmp_path}?bucket=bk1")
    store.put("k", b"x" * 100)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(StoreError):
        store.get_to_file("k", out / "missing-dir" / "f", 1000)
    assert list(out.iterdir()) == []
