"""Bounded storage: our bucket keeps what the run config says (moto S3 and the file store), S3
lifecycle rules are merged in where the provider has them, and local report logs rotate."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from moto.core.authorization import disable_iam_authentication

from node.runtime.report_log import append_line, log_files, read_json_lines
from node.runtime.retention import (
    LIFECYCLE_RULES,
    BackgroundPruner,
    apply_lifecycle,
    doomed,
    our_objects,
    prune_own_bucket,
)
from protocol.credentials import WriteCredentials
from protocol.naming import ObjectKey, ObjectKind, object_key, parse_key
from protocol.runconfig import RetentionConfig, RunConfig, RunConfigError
from protocol.stores import FileStore, ObjectStore, S3Store, StoreError
from tests.support.servers import TEST_ACCESS_KEY_ID, TEST_SECRET, iam_user

RUN = RunConfig.preset("tiny", retention={"windows": 8, "checkpoint_every_kept": 25,
                                          "checkpoint_windows": 60})  # fmt: skip
HOTKEY = "5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY"
OTHER = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"
UID = 3


def _key(window: int, kind: ObjectKind, uid: int = UID, hotkey: str = HOTKEY) -> ObjectKey:
    part = 0 if kind is ObjectKind.CHECKPOINT else None
    return parse_key(object_key(RUN.run_id, window, kind, uid, hotkey, part))


def _validator_history(last: int, every: int = 10) -> list[ObjectKey]:
    """What a validator publishes: per window an aggregate and a fingerprint, a checkpoint and
    its manifest at every multiple of `every`."""
    keys = []
    for w in range(last + 1):
        keys += [_key(w, ObjectKind.AGGREGATE), _key(w, ObjectKind.FINGERPRINT)]
        if w and w % every == 0:
            keys += [_key(w, ObjectKind.CHECKPOINT), _key(w, ObjectKind.MANIFEST)]
    return keys


def _windows(keys: list[ObjectKey], kinds: tuple[ObjectKind, ...]) -> list[int]:
    return sorted({k.window for k in keys if k.kind in kinds})


# -- the rule -----------------------------------------------------------------------------------


def test_a_peer_keeps_its_newest_windows() -> None:
    keys = [_key(w, k) for w in range(41) for k in (ObjectKind.UPDATE, ObjectKind.FINGERPRINT)]
    gone = doomed(keys, RUN.retention, now=40)
    assert _windows(gone, (ObjectKind.UPDATE, ObjectKind.FINGERPRINT)) == list(range(33))
    assert len(gone) == 2 * 33  # windows 33..40 (the newest 8) stay whole
    assert [k.window for k in gone] == sorted(k.window for k in gone)  # oldest first


def test_checkpoints_are_kept_sparser_and_the_replay_chain_whole() -> None:
    keys = _validator_history(100)
    gone = doomed(keys, RUN.retention, now=100)
    kept = [k for k in keys if k not in gone]
    # spans of 25 windows: first checkpoints 10, 30, 50, 80, 100; only those younger than 60
    # windows (> 40) survive the horizon of 8 windows (93..100)
    assert _windows(kept, (ObjectKind.CHECKPOINT,)) == [50, 80, 100]
    assert _windows(kept, (ObjectKind.MANIFEST,)) == [50, 80, 100]
    assert _windows(kept, (ObjectKind.AGGREGATE,)) == list(range(93, 101))


def test_the_newest_checkpoint_and_everything_since_it_are_never_deleted() -> None:
    keys = _validator_history(100, every=40)  # checkpoints at 40 and 80, horizon 93..100
    gone = doomed(keys, RunConfig.preset("tiny").retention.model_copy(update={"windows": 8}), 100)
    kept = [k for k in keys if k not in gone]
    assert _windows(kept, (ObjectKind.AGGREGATE,)) == list(range(80, 101))  # replays from 80
    assert 80 in _windows(kept, (ObjectKind.MANIFEST,))


def test_retention_is_part_of_the_run_config() -> None:
    assert RunConfig.preset("tiny").retention == RetentionConfig()
    assert RUN.run_id != RunConfig.preset("tiny").run_id
    assert RunConfig.from_toml(RUN.to_toml()) == RUN
    with pytest.raises(RunConfigError):
        RunConfig.preset("tiny", retention={"windows": 1})


# -- pruning a real bucket ------------------------------------------------------------------------


@pytest.fixture(params=["file", "s3"])
def bucket(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    if request.param == "file":
        yield FileStore(tmp_path / "bucket")
        return
    url, name = request.getfixturevalue("s3_server"), request.getfixturevalue("s3_bucket")
    store = S3Store(name, WriteCredentials(TEST_ACCESS_KEY_ID, TEST_SECRET), endpoint=url)
    yield store
    store.close()


def test_prune_deletes_only_our_old_objects(bucket: ObjectStore) -> None:
    ours = [_key(w, ObjectKind.UPDATE) for w in range(20)]
    strangers = [
        object_key(RUN.run_id, 0, ObjectKind.UPDATE, UID + 1, OTHER),  # another writer
        object_key(RunConfig.preset("tiny").run_id, 0, ObjectKind.UPDATE, UID, HOTKEY),  # other run
        f"{RUN.run_id}/run.json",
        f"{RUN.run_id}/eval-commits/00003-{HOTKEY}/w0000000000.json",
        f"{RUN.run_id}/w0000000000/notes.txt",  # under a window, but not a name we write
    ]
    for key in [k.render() for k in ours] + strangers:
        bucket.put(key, b"x")
    done = prune_own_bucket(bucket, RUN, UID, HOTKEY, now=19)
    assert done is not None and (done.deleted, done.kept, done.pending) == (12, 8, 0)
    left = {info.key for info in bucket.list()}
    assert left == {k.render() for k in ours[12:]} | set(strangers)


def test_prune_is_bounded_and_catches_up(bucket: ObjectStore) -> None:
    for w in range(30):
        bucket.put(_key(w, ObjectKind.UPDATE).render(), b"x")
    first = prune_own_bucket(bucket, RUN, UID, HOTKEY, now=29, max_deletes=15)
    assert first is not None and (first.deleted, first.pending) == (15, 7)
    assert min(k.window for k in our_objects(bucket, RUN, UID, HOTKEY)) == 15  # oldest first
    second = prune_own_bucket(bucket, RUN, UID, HOTKEY, now=29, max_deletes=15)
    assert second is not None and (second.deleted, second.pending) == (7, 0)
    assert sorted(k.window for k in our_objects(bucket, RUN, UID, HOTKEY)) == list(range(22, 30))


def test_a_failing_bucket_never_fails_the_window(tmp_path: Path) -> None:
    store = FileStore(tmp_path / "bucket", read_only=True)
    (tmp_path / "bucket").mkdir()
    writer = FileStore(tmp_path / "bucket")
    for w in range(12):
        writer.put(_key(w, ObjectKind.UPDATE).render(), b"x")
    assert prune_own_bucket(store, RUN, UID, HOTKEY, now=11) is None  # logged, not raised
    assert len(our_objects(writer, RUN, UID, HOTKEY)) == 12


class StalledStore(FileStore):
    """A bucket whose listing answers only once the test lets it (a throttled provider)."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.go, self.listings = threading.Event(), 0

    def list(self, prefix: str = "", **kw: Any) -> list:
        self.listings += 1
        if not self.go.wait(30):  # a guard: the test releases it long before
            raise StoreError("the test never released the listing")
        return super().list(prefix, **kw)


def test_a_stalled_bucket_never_holds_up_the_next_window(tmp_path: Path) -> None:
    """A node prunes in the background: `start` returns while the bucket has not answered (the
    next window trains meanwhile), a prune due while the last one still runs is skipped, and
    once the bucket answers the old objects go."""
    store = StalledStore(tmp_path / "bucket")
    for w in range(20):
        store.put(_key(w, ObjectKind.UPDATE).render(), b"x")
    pruner = BackgroundPruner(store, RUN, UID, HOTKEY)
    assert pruner.start(19)  # returns with the listing still stalled
    assert not pruner.start(20)  # one prune at a time
    assert len(our_objects(FileStore(tmp_path / "bucket"), RUN, UID, HOTKEY)) == 20
    store.go.set()
    pruner.wait()
    assert store.listings == 1
    assert min(k.window for k in our_objects(store, RUN, UID, HOTKEY)) == 12
    assert pruner.start(21)  # the next window's prune runs again
    pruner.wait()


# -- lifecycle rules -------------------------------------------------------------------------------


def _admin(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        aws_access_key_id=TEST_ACCESS_KEY_ID,
                        aws_secret_access_key=TEST_SECRET)  # fmt: skip


def test_lifecycle_rules_are_merged_with_the_operators(s3_server: str, s3_bucket: str) -> None:
    operator_rule = {"ID": "operator-logs", "Status": "Enabled", "Filter": {"Prefix": "logs/"},
                     "Expiration": {"Days": 30}}  # fmt: skip
    admin = _admin(s3_server)
    admin.put_bucket_lifecycle_configuration(
        Bucket=s3_bucket, LifecycleConfiguration={"Rules": [operator_rule]}
    )
    store = S3Store(
        s3_bucket, WriteCredentials(TEST_ACCESS_KEY_ID, TEST_SECRET), endpoint=s3_server
    )
    assert apply_lifecycle(store)
    rules = admin.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"]
    by_id = {r["ID"]: r for r in rules}
    assert set(by_id) == {"operator-logs", *(r["ID"] for r in LIFECYCLE_RULES)}
    assert by_id["operator-logs"]["Expiration"] == {"Days": 30}
    assert by_id["tessera-abort-incomplete-multipart"]["AbortIncompleteMultipartUpload"] == {
        "DaysAfterInitiation": 1
    }
    sent = store.stats.snapshot()["http_attempts"]
    assert apply_lifecycle(store)  # again: already there
    assert store.stats.snapshot()["http_attempts"] == sent + 1  # one GET, no PUT
    assert admin.get_bucket_lifecycle_configuration(Bucket=s3_bucket)["Rules"] == rules
    admin.close()
    store.close()


def test_no_lifecycle_where_there_is_none(
    tmp_path: Path, s3_server: str, s3_bucket: str, enforced_iam: None
) -> None:
    assert not apply_lifecycle(FileStore(tmp_path / "bucket"))
    with disable_iam_authentication():
        key = iam_user(s3_server, s3_bucket, ["s3:GetObject", "s3:PutObject", "s3:ListBucket",
                                              "s3:DeleteObject"])  # fmt: skip
    store = S3Store(s3_bucket, WriteCredentials(*key), endpoint=s3_server)
    assert not apply_lifecycle(store)  # refused: pruning by deletion alone bounds the bucket
    store.close()


# -- local report logs ------------------------------------------------------------------------------


def _line(i: int) -> str:
    return f'{{"window": {i:>4}, "pad": "{"x" * 40}"}}'  # every line the same length


def test_report_logs_rotate_within_their_bound(tmp_path: Path) -> None:
    path = tmp_path / "state" / "reports.jsonl"
    size = len(_line(0)) + 1
    for i in range(100):
        append_line(path, _line(i), max_bytes=10 * size, keep=2)
    files = log_files(path)
    assert [f.name for f in files] == ["reports.jsonl.2", "reports.jsonl.1", "reports.jsonl"]
    assert all(f.stat().st_size <= 10 * size for f in files)
    assert [r["window"] for r in read_json_lines(path)] == list(range(70, 100))


def test_no_rotated_files_when_none_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "reports.jsonl"
    for i in range(25):
        append_line(path, _line(i), max_bytes=10 * (len(_line(0)) + 1), keep=0)
    assert log_files(path) == [path]
    assert [r["window"] for r in read_json_lines(path)] == list(range(20, 25))


def test_a_crash_during_rotation_loses_no_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "reports.jsonl"
    limit = 5 * (len(_line(0)) + 1)
    for i in range(15):  # three full files: the next line rotates
        append_line(path, _line(i), max_bytes=limit, keep=3)
    before = read_json_lines(path)
    real, calls = os.replace, []

    def crash_on_second(src: Any, dst: Any) -> None:
        calls.append(src)
        if len(calls) == 2:
            raise OSError("power cut")
        real(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_second)
    with pytest.raises(OSError, match="power cut"):
        append_line(path, _line(15), max_bytes=limit, keep=3)
    monkeypatch.setattr(os, "replace", real)
    assert len(calls) == 2 and read_json_lines(path) == before  # every line, in order
    append_line(path, _line(15), max_bytes=limit, keep=3)
    assert [r["window"] for r in read_json_lines(path)][-6:] == list(range(10, 16))


def test_a_torn_line_is_closed_and_skipped(tmp_path: Path) -> None:
    path = tmp_path / "reports.jsonl"
    append_line(path, _line(0))
    with path.open("a") as f:
        f.write('{"window": 1, "pa')  # a crash in the middle of a write
    append_line(path, _line(2))
    assert [r["window"] for r in read_json_lines(path)] == [0, 2]
    with pytest.raises(ValueError):
        append_line(path, "two\nlines")
