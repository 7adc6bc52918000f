"""`tessera doctor`, `tessera bucket create` and `tessera commit` against the embedded chain and a
moto S3 server on loopback.

Moto enforces IAM when `INITIAL_NO_AUTH_ACTION_COUNT` is 0 (`enable_iam_authentication`): then
only keys of IAM users it knows are accepted, with their policies. That gives a real read-only key
(refused on put and delete), a wrong write key (InvalidAccessKeyId), and, with enforcement off, a
read key that *can* write.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from moto.core.authorization import disable_iam_authentication

from commands.cli import main
from commands.doctor.bucket import bandwidth_check
from commands.doctor.chain import clock_check
from commands.doctor.machine import GIB, Gpu, gpu_check
from commands.doctor.report import Status
from commands.doctor.throughput import throughput_check, verdict
from node.runtime.plan import REFERENCE, plan
from protocol.chain import open_chain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import FileStore
from tests.support.servers import iam_user

SEVENTY_B = Path(__file__).resolve().parents[2] / "lab" / "configs" / "70b.toml"

NETUID = 1
CHECKS = [
    "versions",
    "run",
    "gpu",
    "disk",
    "throughput",
    "hotkey",
    "chain",
    "registration",
    "commitment",
    "clock",
    "bucket",
    "read key",
    "bandwidth",
]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("TESSERA_", "AWS_")):
            monkeypatch.delenv(name)


class World:
    """An embedded chain, one hotkey in a wallet folder, and the node arguments that name them."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.db = root / "chain.db"
        create_local_chain(self.db, NETUID, block_time=1.0)
        self.hotkey = create_hotkey("w", "h", root=root / "wallets").ss58_address

    def register(self, validator: bool = False) -> None:
        db = LocalChainDB(self.db)
        try:
            db.register(NETUID, self.hotkey, validator=validator, stake=10.0 if validator else 0)
        finally:
            db.close()

    def args(self, store: str) -> list[str]:
        return [
            "--chain", f"local://{self.db}", "--netuid", str(NETUID), "--store", store,
            "--wallet", "w", "--hotkey", "h", "--wallet-path", str(self.root / "wallets"),
            "--state-dir", str(self.root / "state"), "--device", "cpu",
        ]  # fmt: skip


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def file_store(world: World) -> str:
    return f"file://{world.root / 'buckets'}?bucket=peer"


def doctor(
    capsys: pytest.CaptureFixture[str], *argv: str
) -> tuple[int, dict[str, dict[str, str]], str]:
    capsys.readouterr()  # drop what earlier commands printed
    rc = main(["doctor", *argv, "--bandwidth-mb", "1", "--train-steps", "0", "--json"])
    out = capsys.readouterr().out
    report = json.loads(out)
    names = [c["name"] for c in report["checks"]]
    assert names == CHECKS  # one entry per check, always in this order
    assert report["ok"] is (rc == 0)
    return rc, {c["name"]: c for c in report["checks"]}, out


def no_failures(rows: dict[str, dict[str, str]]) -> bool:
    return all(row["status"] != "fail" for row in rows.values())


# -- the embedded store ---------------------------------------------------------------------------


def test_healthy_file_store_passes(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    world.register()
    args = world.args(file_store(world))
    assert main(["commit", *args]) == 0
    assert "posted" in capsys.readouterr().out
    assert main(["commit", *args]) == 0  # idempotent
    assert "already on chain" in capsys.readouterr().out

    rc, rows, _ = doctor(capsys, *args)
    assert rc == 0, rows
    assert rows["gpu"]["status"] == "warn"  # CPU only, tiny: a warning, not a failure
    assert rows["read key"]["status"] == "skip" and "does not apply" in rows["read key"]["detail"]
    assert rows["registration"]["detail"].startswith("uid 0")
    assert RunConfig.preset("tiny").run_id in rows["run"]["detail"]

    assert main(["doctor", *args, "--bandwidth-mb", "1", "--train-steps", "0"]) == 0  # checklist
    text = capsys.readouterr().out
    assert "✓" in text and "!" in text and "ready" in text


def test_unregistered_hotkey_fails_with_register_fix(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, rows, _ = doctor(capsys, *world.args(file_store(world)))
    assert rc == 1
    row = rows["registration"]
    assert row["status"] == "fail" and "not registered" in row["detail"]
    assert (
        f"tessera chain register --db {world.db} --netuid 1 --hotkey {world.hotkey}" in row["fix"]
    )


def test_missing_commitment_fails_with_commit_fix(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.register()
    rc, rows, _ = doctor(capsys, *world.args(file_store(world)))
    assert rc == 1
    row = rows["commitment"]
    assert row["status"] == "fail" and "missing" in row["detail"]
    assert "tessera miner --commit" in row["fix"] and "tessera commit" in row["fix"]
    assert [n for n, r in rows.items() if r["status"] == "fail"] == ["commitment"]


def test_stale_commitment_names_what_differs(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.register()
    assert main(["commit", *world.args(f"file://{world.root / 'buckets'}?bucket=old")]) == 0
    rc, rows, _ = doctor(capsys, *world.args(file_store(world)))
    assert rc == 1
    assert "stale" in rows["commitment"]["detail"] and "bucket old" in rows["commitment"]["detail"]


def test_validator_needs_a_permit(world: World, capsys: pytest.CaptureFixture[str]) -> None:
    world.register()
    args = world.args(file_store(world))
    main(["commit", *args])
    rc, rows, _ = doctor(capsys, *args, "--role", "validator")
    assert rc == 1 and "no validator permit" in rows["registration"]["detail"]
    assert "stake" in rows["registration"]["fix"]
    db = LocalChainDB(world.db)
    db.set_validator_permit(NETUID, world.hotkey, True)
    db.close()
    rc, rows, _ = doctor(capsys, *args, "--role", "validator")
    assert rc == 0 and "validator permit" in rows["registration"]["detail"]


def test_missing_chain_and_store_fail_and_skip_dependents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, rows, _ = doctor(capsys, "--wallet-path", str(tmp_path), "--state-dir", str(tmp_path))
    assert rc == 1
    assert rows["chain"]["fix"] == "pass --chain or set TESSERA_CHAIN"
    assert rows["bucket"]["fix"] == "pass --store or set TESSERA_STORE"
    assert rows["hotkey"]["status"] == "fail" and "btcli wallet new_hotkey" in rows["hotkey"]["fix"]
    for name in ("registration", "commitment", "clock", "read key", "bandwidth"):
        assert rows[name]["status"] == "skip"


# -- S3 (moto) ------------------------------------------------------------------------------------


@pytest.fixture
def iam_keys(s3_server: str) -> dict[str, tuple[str, str]]:
    bucket = f"tessera-doctor-{uuid.uuid4().hex[:10]}"
    return {
        "bucket": (bucket, ""),
        "write": iam_user(s3_server, bucket, ["s3:*"]),
        "read": iam_user(s3_server, bucket, ["s3:GetObject", "s3:ListBucket"]),
    }


def _set_keys(mp: pytest.MonkeyPatch, write: tuple[str, str], read: tuple[str, str]) -> None:
    mp.setenv("TESSERA_S3_ACCESS_KEY_ID", write[0])
    mp.setenv("TESSERA_S3_SECRET_ACCESS_KEY", write[1])
    mp.setenv("TESSERA_S3_READ_ACCESS_KEY_ID", read[0])
    mp.setenv("TESSERA_S3_READ_SECRET_ACCESS_KEY", read[1])


def test_healthy_s3_store_passes_with_enforced_read_only_key(
    world: World,
    s3_server: str,
    iam_keys: dict[str, Any],
    enforced_iam: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _set_keys(monkeypatch, iam_keys["write"], iam_keys["read"])
    url = f"s3://{iam_keys['bucket'][0]}?endpoint={s3_server}&region=us-east-1"
    assert main(["bucket", "create", "--store", url]) == 0
    assert "created" in capsys.readouterr().out
    assert main(["bucket", "create", "--store", url]) == 0  # idempotent
    assert "already exists" in capsys.readouterr().out

    world.register()
    args = world.args(url)
    assert main(["commit", *args]) == 0
    rc, rows, out = doctor(capsys, *args)
    assert rc == 0, rows
    assert rows["read key"]["status"] == "ok" and "refused" in rows["read key"]["detail"]
    assert rows["bucket"]["status"] == "ok"
    assert "MB/s" in rows["bandwidth"]["detail"]
    main(["doctor", *args, "--bandwidth-mb", "1"])
    text = out + capsys.readouterr().out
    for secret in (iam_keys["write"][1], iam_keys["read"][1], iam_keys["write"][0]):
        assert secret not in text  # secrets (and the write key id) never printed


def test_wrong_write_key_fails_with_key_fix(
    world: World,
    s3_server: str,
    s3_bucket: str,
    iam_keys: dict[str, Any],
    enforced_iam: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _set_keys(monkeypatch, ("no-such-key-id", "wrong-secret-value"), iam_keys["read"])
    world.register()
    rc, rows, out = doctor(capsys, *world.args(f"s3://{s3_bucket}?endpoint={s3_server}"))
    assert rc == 1
    row = rows["bucket"]
    assert row["status"] == "fail" and "access denied" in row["detail"]
    assert "TESSERA_S3_ACCESS_KEY_ID" in row["fix"]
    assert rows["read key"]["status"] == "skip" and rows["bandwidth"]["status"] == "skip"
    assert "wrong-secret-value" not in out


def test_read_key_that_can_write_fails(
    world: World,
    s3_server: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # without IAM enforcement moto lets any key write: the stand-in for a misconfigured key
    _set_keys(monkeypatch, ("writer-key-id", "writer-secret"), ("reader-key-id", "reader-secret"))
    world.register()
    url = f"s3://{s3_bucket}?endpoint={s3_server}"
    assert main(["commit", *world.args(url)]) == 1  # such a key never goes on chain
    assert "refusing to commit the read key" in capsys.readouterr().err
    rc, rows, _ = doctor(capsys, *world.args(url))
    assert rc == 1
    row = rows["read key"]
    assert row["status"] == "fail" and "can write" in row["detail"]
    assert "create a read-only key" in row["fix"]
    assert [n for n, r in rows.items() if r["status"] == "fail"] == ["commitment", "read key"]

    _set_keys(monkeypatch, ("writer-key-id", "writer-secret"), ("writer-key-id", "writer-secret"))
    rc, rows, _ = doctor(capsys, *world.args(url))
    assert rc == 1 and "is the write key" in rows["read key"]["detail"]


def test_missing_bucket_suggests_bucket_create(
    world: World,
    s3_server: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _set_keys(monkeypatch, ("writer-key-id", "writer-secret"), ("reader-key-id", "reader-secret"))
    url = f"s3://tessera-missing-{uuid.uuid4().hex[:8]}?endpoint={s3_server}"
    _, rows, _ = doctor(capsys, *world.args(url))
    assert rows["bucket"]["status"] == "fail"
    assert rows["bucket"]["fix"] == f"create the bucket: tessera bucket create --store '{url}'"


# -- single checks ----------------------------------------------------------------------------


def test_gpu_fit_against_presets() -> None:
    tiny, big = RunConfig.preset("tiny"), RunConfig.preset("8B")
    h100 = [Gpu("H100", 80 * GIB)] * 8
    assert gpu_check(tiny, "cuda", h100).status is Status.OK
    row = gpu_check(big, "cuda", h100)
    assert row.status is Status.FAIL and "FSDP2" in row.detail and "1B" in row.fix
    assert "≥ 2 such GPUs" in row.detail
    assert gpu_check(big, "cpu", []).status is Status.FAIL
    assert gpu_check(tiny, "cpu", []).status is Status.WARN
    assert "no CUDA GPU" in gpu_check(tiny, "cuda", []).detail


def test_throughput_is_measured_and_a_slow_box_warns(
    world: World, capsys: pytest.CaptureFixture[str]
) -> None:
    world.register()
    args = world.args(file_store(world))
    main(["doctor", *args, "--bandwidth-mb", "0", "--train-steps", "1", "--json"])
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checks"]}
    row = rows["throughput"]  # ok or warn: this machine's speed decides
    assert row["status"] in ("ok", "warn") and "tokens/s on cpu" in row["detail"], row
    assert "busy" in row["detail"]
    run = RunConfig.preset("tiny")
    box = REFERENCE["tiny"]
    window_tokens_per_s = run.inner_steps * run.batch_size * run.seq_len / 20.0
    fast = verdict(run, plan(run, box, tokens_per_s=4 * window_tokens_per_s), "measured")
    assert fast.status is Status.OK and "25% busy" in fast.detail
    slow = verdict(run, plan(run, box, tokens_per_s=window_tokens_per_s), "measured")
    assert slow.status is Status.WARN and "miss the upload deadline" in slow.detail
    assert "--suggest" in slow.fix
    assert throughput_check(RunConfig.preset("8B"), "cpu", [], 1, 1.0).status is Status.SKIP
    assert throughput_check(run, "cuda", [], 1, 1.0).status is Status.SKIP
    assert throughput_check(run, "cpu", [], 0, 1.0).status is Status.SKIP


def test_clock_skew_is_caught(world: World) -> None:
    run = RunConfig.preset("tiny")
    with open_chain(f"local://{world.db}", netuid=NETUID) as chain:
        assert clock_check(chain, run).status is Status.OK
        ahead = clock_check(chain, run, now=lambda: time.time() + 30)
        behind = clock_check(chain, run, now=lambda: time.time() - 30)
    assert ahead.status is Status.FAIL and "ahead" in ahead.detail and "NTP" in ahead.fix
    assert behind.status is Status.FAIL and "behind" in behind.detail


class SlowStore(FileStore):
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        time.sleep(0.2)
        super().put(key, data)


def test_slow_link_warns_for_a_large_preset(tmp_path: Path) -> None:
    store = SlowStore(tmp_path / "bucket")
    row = bandwidth_check(store, RunConfig.load(SEVENTY_B), 1, downloads=20)
    assert row.status is Status.WARN and "faster link" in row.fix
    assert bandwidth_check(store, RunConfig.preset("tiny"), 1, 8).status is Status.OK
    assert store.list() == []  # the probe object is gone


def test_read_key_without_list_warns_for_miners_and_fails_for_validators(
    world: World,
    s3_server: str,
    s3_bucket: str,
    enforced_iam: None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with disable_iam_authentication():
        write = iam_user(s3_server, s3_bucket, ["s3:*"])
        read = iam_user(s3_server, s3_bucket, ["s3:GetObject"])
    _set_keys(monkeypatch, write, read)
    url = f"s3://{s3_bucket}?endpoint={s3_server}"
    world.register(validator=True)
    assert main(["commit", *world.args(url)]) == 0
    rc, rows, _ = doctor(capsys, *world.args(url))
    assert rc == 0 and rows["read key"]["status"] == "warn"
    assert (
        "list refused" in rows["read key"]["detail"] and "put refused" in rows["read key"]["detail"]
    )
    rc, rows, _ = doctor(capsys, *world.args(url), "--role", "validator")
    assert rc == 1 and "s3:ListBucket" in rows["read key"]["fix"]


def test_malformed_read_key_is_reported_without_quoting_it(
    world: World,
    s3_server: str,
    s3_bucket: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    secret = "S3CR3T" * 30  # longer than any key: pydantic would echo it back
    _set_keys(monkeypatch, ("writer-key-id", "writer-secret"), ("reader-key-id", secret))
    world.register()
    assert main(["commit", *world.args(f"s3://{s3_bucket}?endpoint={s3_server}")]) == 1
    committed = capsys.readouterr()
    assert "cannot be committed" in committed.err and "S3CR3T" not in committed.err
    rc, rows, out = doctor(capsys, *world.args(f"s3://{s3_bucket}?endpoint={s3_server}"))
    assert rc == 1 and rows["read key"]["status"] == "fail"
    assert rows["commitment"]["status"] == "fail" and "docs/buckets.md" in rows["commitment"]["fix"]
    assert "S3CR3T" not in out + capsys.readouterr().err
