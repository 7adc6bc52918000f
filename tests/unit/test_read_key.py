"""No key that can write ever goes on chain: the simulation and a node's start-up ask the server.

Moto with IAM enforced (`enforced_iam`) plays the provider: a "read" key whose IAM policy allows
writes is refused, a key allowed only s3:GetObject and s3:ListBucket is accepted. (`tessera commit`
follows the same rule: tests/unit/test_doctor.py.)
"""

from __future__ import annotations

import argparse
import os
import uuid
from pathlib import Path

import pytest
from moto.core.authorization import disable_iam_authentication

from commands.node_args import add_node_arguments, connect, load_key
from lab.sim.buckets import SimKeyError, read_key_env
from lab.sim.layout import build_world
from node.runtime.commit import commitment_for, ensure_commitment
from node.runtime.read_key import ReadKeyCanWrite
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.commitment import parse_commitment
from protocol.credentials import ReadCredentials
from protocol.keys import create_hotkey, load_hotkey
from tests.support.servers import iam_user

READ_ONLY = ["s3:GetObject", "s3:ListBucket"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith(("TESSERA_", "AWS_")):
            monkeypatch.delenv(name)


def _keys(mp: pytest.MonkeyPatch, write: tuple[str, str], read: tuple[str, str] | None) -> None:
    mp.setenv("TESSERA_S3_ACCESS_KEY_ID", write[0])
    mp.setenv("TESSERA_S3_SECRET_ACCESS_KEY", write[1])
    if read is not None:
        mp.setenv("TESSERA_S3_READ_ACCESS_KEY_ID", read[0])
        mp.setenv("TESSERA_S3_READ_SECRET_ACCESS_KEY", read[1])


def _users(s3_server: str, bucket: str, read_actions: list[str]) -> dict[str, tuple[str, str]]:
    with disable_iam_authentication():  # creating users needs no key of its own
        return {
            "write": iam_user(s3_server, bucket, ["s3:*"]),
            "read": iam_user(s3_server, bucket, read_actions),
        }


def _sim(tmp_path: Path, prefix: str, s3_server: str) -> list[str]:
    world = build_world(tmp_path / "sim", 2, 1.0, 10, 1, [], f"s3://{prefix}?endpoint={s3_server}")
    return [m.store_url for m in world.members]


def test_the_simulation_never_falls_back_to_the_write_key(
    tmp_path: Path, s3_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _keys(monkeypatch, ("writer-key-id", "writer-secret"), None)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "aws-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-secret")
    with pytest.raises(SimKeyError, match="TESSERA_S3_READ_ACCESS_KEY_ID"):
        read_key_env()
    with pytest.raises(SimKeyError):
        _sim(tmp_path, f"simkey-{uuid.uuid4().hex[:8]}", s3_server)


@pytest.mark.parametrize("read_actions", [["s3:*"], ["s3:GetObject", "s3:PutObject"]])
def test_the_simulation_refuses_a_read_key_that_can_write(
    tmp_path: Path,
    s3_server: str,
    enforced_iam: None,
    monkeypatch: pytest.MonkeyPatch,
    read_actions: list[str],
) -> None:
    prefix = f"simkey-{uuid.uuid4().hex[:8]}"
    users = _users(s3_server, f"{prefix}-*", read_actions)
    _keys(monkeypatch, users["write"], users["read"])
    with pytest.raises(SimKeyError, match="refusing to commit the read key"):
        _sim(tmp_path, prefix, s3_server)


def test_the_simulation_accepts_a_read_only_key(
    tmp_path: Path, s3_server: str, enforced_iam: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"simkey-{uuid.uuid4().hex[:8]}"
    users = _users(s3_server, f"{prefix}-*", READ_ONLY)
    _keys(monkeypatch, users["write"], users["read"])
    urls = _sim(tmp_path, prefix, s3_server)
    assert len(urls) == 2 and all(u.startswith(f"s3://{prefix}-") for u in urls)
    env = read_key_env()
    assert env["TESSERA_S3_READ_ACCESS_KEY_ID"] == users["read"][0] != users["write"][0]


def _start_up_args(tmp_path: Path, url: str) -> tuple[argparse.Namespace, str]:
    db = tmp_path / "chain.db"
    create_local_chain(db, 1, block_time=1.0)
    hotkey = create_hotkey("w", "h", root=tmp_path / "wallets").ss58_address
    chain_db = LocalChainDB(db)
    chain_db.register(1, hotkey)
    chain_db.close()
    parser = argparse.ArgumentParser()
    add_node_arguments(parser)
    args = parser.parse_args(
        ["--chain", f"local://{db}", "--store", url, "--wallet", "w", "--hotkey", "h",
         "--wallet-path", str(tmp_path / "wallets"), "--commit"]
    )  # fmt: skip
    return args, hotkey


def _committed(args: argparse.Namespace, hotkey: str) -> str | None:
    chain = LocalChain(args.chain.removeprefix("local://"), 1)
    try:
        found = chain.read_commitment(hotkey)
    finally:
        chain.close()
    if found is None:
        return None
    return parse_commitment(found.data, allow_private_endpoints=True).credentials.access_key_id


@pytest.mark.parametrize(("read_actions", "accepted"), [(["s3:*"], False), (READ_ONLY, True)])
def test_a_node_starting_with_commit_posts_only_a_read_only_key(
    tmp_path: Path,
    s3_server: str,
    s3_bucket: str,
    enforced_iam: None,
    monkeypatch: pytest.MonkeyPatch,
    read_actions: list[str],
    accepted: bool,
) -> None:
    users = _users(s3_server, s3_bucket, read_actions)
    _keys(monkeypatch, users["write"], users["read"])
    args, hotkey = _start_up_args(tmp_path, f"s3://{s3_bucket}?endpoint={s3_server}")
    keypair = load_key(args)
    if accepted:
        chain, store = connect(args, keypair, "miner")
        store.close()
        chain.close()
        assert _committed(args, hotkey) == users["read"][0]
    else:
        with pytest.raises(ReadKeyCanWrite):
            connect(args, keypair, "miner")
        assert _committed(args, hotkey) is None


def test_a_key_is_never_posted_without_the_check(tmp_path: Path) -> None:
    args, hotkey = _start_up_args(tmp_path, "s3://bucket?endpoint=https://s3.example.org")
    read = ReadCredentials(access_key_id="reader-key-id", secret_access_key="reader-secret")
    wanted = commitment_for(args.store, read)
    chain = LocalChain(args.chain.removeprefix("local://"), 1)
    keypair = load_hotkey("w", "h", tmp_path / "wallets")
    try:
        with pytest.raises(ValueError, match="key check"):
            ensure_commitment(chain, keypair, wanted, post=True)
    finally:
        chain.close()
    assert _committed(args, hotkey) is None
