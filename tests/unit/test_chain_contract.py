"""One contract for every `Chain`: the embedded local chain always, subtensor when SUBTENSOR_URL is set.

Against a real node (e.g. the compose profile `localnet`, see docs/chains.md), only the subtensor
cases (marker `subtensor`):

    SUBTENSOR_URL=ws://127.0.0.1:9944 bash scripts/test.sh -m subtensor

The keys are dev URIs (`SUBTENSOR_VALIDATOR_URI`, default //Alice; `SUBTENSOR_MINER_URIS`, default
//Bob,//Charlie), or wallet hotkeys given as `SUBTENSOR_WALLET_HOTKEYS=wallet/hotkey,...` (the first
is the validator). Unregistered dev keys are registered with `burned_register`, paid by the key
itself. Steps the node's state cannot support (no validator permit yet, commit-reveal weights,
rate limits) are skipped with the reason.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import UTC
from pathlib import Path

import pytest
from substrateinterface import Keypair

from protocol.chain import (
    BlockNotFinal,
    Chain,
    ChainError,
    ChainSnapshot,
    CommitmentTooLarge,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
    open_chain,
)
from protocol.chain.local_db import LocalChainDB, create_local_chain
from tests.support.chain_workers import run_worker

LOCAL_NETUID = 3


@dataclass
class ChainEnv:
    chain: Chain
    validator: Keypair
    miners: list[Keypair]
    stranger: Keypair
    kind: str

    def uid(self, keypair: Keypair) -> int:
        uid = self.chain.uid_of(keypair.ss58_address)
        assert uid is not None
        return uid


def _fresh_keypair() -> Keypair:
    return Keypair.create_from_seed(secrets.token_hex(32))


def _local_env(tmp_path: Path) -> ChainEnv:
    db = tmp_path / "chain.db"
    create_local_chain(db, LOCAL_NETUID, block_time=0.05, tempo=100)
    validator = Keypair.create_from_uri("//Alice")
    miners = [Keypair.create_from_uri("//Bob"), Keypair.create_from_uri("//Charlie")]
    admin = LocalChainDB(db)
    admin.register(LOCAL_NETUID, validator.ss58_address, validator=True, stake=1000.0)
    for miner in miners:
        admin.register(LOCAL_NETUID, miner.ss58_address, stake=1.5)
    admin.close()
    chain = open_chain(f"local://{db}", netuid=LOCAL_NETUID)
    return ChainEnv(chain, validator, miners, _fresh_keypair(), "local")


def _subtensor_keys() -> tuple[Keypair, list[Keypair]]:
    wallet_spec = os.environ.get("SUBTENSOR_WALLET_HOTKEYS", "").strip()
    if wallet_spec:
        from protocol.keys import load_hotkey

        pairs = [item.split("/", 1) for item in wallet_spec.split(",") if item.strip()]
        keys = [load_hotkey(wallet.strip(), hotkey.strip()) for wallet, hotkey in pairs]
        return keys[0], keys[1:]
    validator = Keypair.create_from_uri(os.environ.get("SUBTENSOR_VALIDATOR_URI", "//Alice"))
    uris = os.environ.get("SUBTENSOR_MINER_URIS", "//Bob,//Charlie").split(",")
    return validator, [Keypair.create_from_uri(uri.strip()) for uri in uris if uri.strip()]


def _ensure_registered(chain: Chain, keypair: Keypair) -> None:
    if chain.uid_of(keypair.ss58_address) is not None:
        return
    s = chain.substrate  # type: ignore[attr-defined]
    call = s.compose_call(
        call_module="SubtensorModule",
        call_function="burned_register",
        call_params={"netuid": chain.netuid, "hotkey": keypair.ss58_address},
    )
    try:
        receipt = s.submit_extrinsic(
            s.create_signed_extrinsic(call=call, keypair=keypair), wait_for_inclusion=True
        )
        problem = None if receipt.is_success else receipt.error_message
    except Exception as exc:  # the node refused the transaction (funds, limits, ...)
        problem = exc
    if problem is not None or chain.uid_of(keypair.ss58_address) is None:
        pytest.skip(f"could not register {keypair.ss58_address}: {problem}")


def _subtensor_env() -> ChainEnv:
    url = os.environ.get("SUBTENSOR_URL")
    if not url:
        pytest.skip(
            "SUBTENSOR_URL not set: start a localnet (docs/chains.md) and set "
            "SUBTENSOR_URL=ws://127.0.0.1:9944 to run the contract against subtensor"
        )
    chain = open_chain(url, netuid=int(os.environ.get("SUBTENSOR_NETUID", "1")))
    validator, miners = _subtensor_keys()
    for keypair in [validator, *miners]:
        _ensure_registered(chain, keypair)
    return ChainEnv(chain, validator, miners, _fresh_keypair(), "subtensor")


@pytest.fixture(params=["local", pytest.param("subtensor", marks=pytest.mark.subtensor)])
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ChainEnv]:
    made = _local_env(tmp_path) if request.param == "local" else _subtensor_env()
    try:
        yield made
    finally:
        made.chain.close()


def _wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def _set_weights_or_skip(env: ChainEnv, uids: list[int], weights: list[float], vk: int) -> None:
    if env.kind == "subtensor":
        validator_uid = env.uid(env.validator)
        neuron = env.chain.metagraph().neuron(validator_uid)
        if neuron is None or not neuron.validator_permit:
            pytest.skip("the validator hotkey has no validator permit on this subnet yet")
        if env.chain.commit_reveal_enabled():  # type: ignore[attr-defined]
            pytest.skip("the subnet requires commit-reveal weights")
    try:
        env.chain.set_weights(env.validator, uids, weights, vk)
    except RateLimited as exc:
        if env.kind != "subtensor":
            raise
        pytest.skip(f"weights rate limit on the node: {exc}")


# -- time --------------------------------------------------------------------------------------


def test_blocks_advance_and_have_utc_timestamps(env: ChainEnv) -> None:
    first = env.chain.block()
    assert first >= 0
    assert _wait_for(lambda: env.chain.block() > first, timeout_s=60)
    now = env.chain.block()
    t_first, t_now = env.chain.block_timestamp(first), env.chain.block_timestamp(now)
    assert t_first.tzinfo is not None and t_first.utcoffset() == UTC.utcoffset(None)
    assert t_first < t_now
    with pytest.raises(ChainError):
        env.chain.block_timestamp(now + 10_000)


# -- membership --------------------------------------------------------------------------------


def test_metagraph_lists_registered_hotkeys(env: ChainEnv) -> None:
    metagraph = env.chain.metagraph()
    assert metagraph.netuid == env.chain.netuid
    assert metagraph.block <= env.chain.block()
    for keypair in [env.validator, *env.miners]:
        uid = env.chain.uid_of(keypair.ss58_address)
        assert uid is not None
        assert metagraph.uid_of(keypair.ss58_address) == uid
        neuron = metagraph.neuron(uid)
        assert neuron is not None and neuron.hotkey == keypair.ss58_address
        assert math.isfinite(neuron.stake) and neuron.stake >= 0
    assert env.chain.uid_of(env.stranger.ss58_address) is None
    assert metagraph.uid_of(env.stranger.ss58_address) is None
    if env.kind == "local":
        assert metagraph.neuron(env.uid(env.validator)).validator_permit  # type: ignore[union-attr]
        assert metagraph.neuron(env.uid(env.validator)).stake == 1000.0  # type: ignore[union-attr]


# -- commitments -------------------------------------------------------------------------------


def test_commit_round_trip(env: ChainEnv) -> None:
    miner = env.miners[0]
    data = secrets.token_bytes(97)
    committed = env.chain.commit(miner, data)
    assert committed.data == data and committed.hotkey == miner.ss58_address
    assert committed.block <= env.chain.block()
    assert env.chain.read_commitment(miner.ss58_address) == committed
    assert env.chain.read_all_commitments()[miner.ss58_address] == committed


def test_commit_replaces_previous_and_accepts_limits(env: ChainEnv) -> None:
    miner = env.miners[1]
    env.chain.commit(miner, b"first")
    full = bytes(range(128))
    second = env.chain.commit(miner, full)
    read = env.chain.read_commitment(miner.ss58_address)
    assert read is not None and read.data == full and read.block == second.block


def test_commit_too_large_is_refused_before_the_chain(env: ChainEnv) -> None:
    with pytest.raises(CommitmentTooLarge):
        env.chain.commit(env.miners[0], b"x" * 129)


def test_unregistered_hotkey_cannot_commit(env: ChainEnv) -> None:
    with pytest.raises(NotRegistered, match="register"):
        env.chain.commit(env.stranger, b"hello")
    assert env.chain.read_commitment(env.stranger.ss58_address) is None


def test_public_key_only_keypair_cannot_write(env: ChainEnv) -> None:
    impostor = Keypair(ss58_address=env.miners[0].ss58_address)
    with pytest.raises(PermissionDenied):
        env.chain.commit(impostor, b"forged")


# -- weights -----------------------------------------------------------------------------------


def test_set_and_read_weights(env: ChainEnv) -> None:
    m0, m1 = (env.uid(m) for m in env.miners[:2])
    _set_weights_or_skip(env, [m0, m1], [1.0, 3.0], 1)
    validator_uid = env.uid(env.validator)
    tolerance = 1e-12 if env.kind == "local" else 1e-4
    for key in (validator_uid, env.validator.ss58_address):
        got = env.chain.read_weights(key)
        assert set(got) == {m0, m1}
        assert got[m0] == pytest.approx(0.25, abs=tolerance)
        assert got[m1] == pytest.approx(0.75, abs=tolerance)
    assert env.chain.weights_all()[validator_uid] == env.chain.read_weights(validator_uid)


def test_zero_weights_are_dropped(env: ChainEnv) -> None:
    m0, m1 = (env.uid(m) for m in env.miners[:2])
    _set_weights_or_skip(env, [m0, m1], [0.0, 2.0], 2)
    assert env.chain.read_weights(env.uid(env.validator)) == {m1: pytest.approx(1.0)}


@pytest.mark.parametrize(
    ("uids", "weights"),
    [
        ([0, 1], [1.0]),
        ([0, 0], [1.0, 1.0]),
        ([0], [float("nan")]),
        ([0], [float("inf")]),
        ([0], [-1.0]),
        ([0, 1], [0.0, 0.0]),
        ([70_000], [1.0]),
    ],
)
def test_invalid_weights_are_refused(env: ChainEnv, uids: list[int], weights: list[float]) -> None:
    with pytest.raises(InvalidWeights):
        env.chain.set_weights(env.validator, uids, weights, 1)


def test_unregistered_hotkey_cannot_set_or_have_weights(env: ChainEnv) -> None:
    with pytest.raises(NotRegistered):
        env.chain.set_weights(env.stranger, [0], [1.0], 1)
    with pytest.raises(NotRegistered):
        env.chain.read_weights(env.stranger.ss58_address)


# -- snapshots ---------------------------------------------------------------------------------


def _final_snapshot(chain: Chain, block: int, timeout_s: float = 120) -> ChainSnapshot:
    """`chain.snapshot(block)` as soon as `block` is final."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return chain.snapshot(block)
        except BlockNotFinal:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _commit_or_skip(env: ChainEnv, keypair: Keypair, data: bytes) -> int:
    try:
        return env.chain.commit(keypair, data).block
    except RateLimited as exc:
        if env.kind != "subtensor":
            raise
        pytest.skip(f"commitment rate limit on the node: {exc}")


def test_snapshot_is_pinned_to_its_block(env: ChainEnv) -> None:
    miner = env.miners[0]
    first = _commit_or_skip(env, miner, b"pinned " + secrets.token_bytes(8))
    pinned = _final_snapshot(env.chain, first)
    assert pinned.block == pinned.metagraph.block == first
    assert pinned.metagraph.netuid == env.chain.netuid
    assert pinned.commitments[miner.ss58_address] == env.chain.read_commitment(miner.ss58_address)
    for keypair in [env.validator, *env.miners]:
        uid = pinned.metagraph.uid_of(keypair.ss58_address)
        assert uid is not None and uid == env.chain.uid_of(keypair.ss58_address)
        assert pinned.metagraph.neuron(uid).registered_block <= first  # type: ignore[union-attr]
    second = _commit_or_skip(env, miner, b"later " + secrets.token_bytes(8))
    assert second > first
    later = _final_snapshot(env.chain, second)
    assert env.chain.snapshot(first) == pinned  # the later commit did not reach block `first`
    assert later.commitments[miner.ss58_address].block == second
    assert later.commitments[miner.ss58_address] != pinned.commitments[miner.ss58_address]
    with pytest.raises(BlockNotFinal):
        env.chain.snapshot(env.chain.block() + 1000)


# -- many processes, one local chain -----------------------------------------------------------


def test_local_chain_is_consistent_under_concurrent_processes(tmp_path: Path) -> None:
    db = tmp_path / "chain.db"
    create_local_chain(db, LOCAL_NETUID, block_time=0.02, tempo=50)
    uris = ["//Alice", "//Bob", "//Charlie", "//Dave"]
    validators = {"//Alice", "//Bob"}
    admin = LocalChainDB(db)
    for uri in uris:
        admin.register(
            LOCAL_NETUID,
            Keypair.create_from_uri(uri).ss58_address,
            validator=uri in validators,
            stake=10.0,
        )
    admin.close()
    miner_uids = [2, 3]
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(len(uris))
    specs = [
        {
            "db": str(db),
            "netuid": LOCAL_NETUID,
            "uri": uri,
            "validator": uri in validators,
            "miner_uids": miner_uids,
            "rounds": 20,
            "n": len(uris),
        }
        for uri in uris
    ]
    procs = [ctx.Process(target=run_worker, args=(spec, results, barrier)) for spec in specs]
    for proc in procs:
        proc.start()
    outs = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    for out in outs:
        assert out["problems"] == [], out["problems"]
        assert out["blocks"] == sorted(out["blocks"])
    chain = open_chain(f"local://{db}", netuid=LOCAL_NETUID)
    commitments = chain.read_all_commitments()
    by_uri = {out["uri"]: out for out in outs}
    for uri in uris:
        hotkey = Keypair.create_from_uri(uri).ss58_address
        assert commitments[hotkey].data == by_uri[uri]["last_data"].encode()
        assert commitments[hotkey].block == by_uri[uri]["blocks"][-1]
    all_weights = chain.weights_all()
    assert set(all_weights) == {0, 1}
    for uri in validators:
        uid = chain.uid_of(Keypair.create_from_uri(uri).ss58_address)
        assert uid is not None
        last = by_uri[uri]["last_weights"]
        total = sum(last.values())
        assert all_weights[uid] == {u: pytest.approx(w / total) for u, w in last.items()}
    assert chain.metagraph().n == len(uris)
    chain.close()
