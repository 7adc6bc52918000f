"""Local-chain specifics: the clock, the CLI, size and rate limits, registration and signatures."""

from __future__ import annotations

import json
import math
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from substrateinterface import Keypair, KeypairType

import commands.cli
from protocol.chain import (
    ChainError,
    CommitmentTooLarge,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
    open_chain,
)
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.chain.url import local_path

NETUID = 5
ALICE = Keypair.create_from_uri("//Alice")
BOB = Keypair.create_from_uri("//Bob")
CHARLIE = Keypair.create_from_uri("//Charlie")


class FakeClock:
    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def db_path(tmp_path: Path, clock: FakeClock) -> Path:
    path = tmp_path / "chain.db"
    create_local_chain(path, NETUID, block_time=12.0, tempo=10, clock=clock)
    admin = LocalChainDB(path, clock=clock)
    admin.register(NETUID, ALICE.ss58_address, validator=True, stake=100.0)
    admin.register(NETUID, BOB.ss58_address)
    admin.close()
    return path


@pytest.fixture
def chain(db_path: Path, clock: FakeClock) -> Iterator[LocalChain]:
    handle = LocalChain(db_path, NETUID, clock=clock)
    yield handle
    handle.close()


# -- clock -------------------------------------------------------------------------------------


def test_blocks_follow_the_clock(chain: LocalChain, clock: FakeClock) -> None:
    genesis = chain.block_timestamp(0)
    assert chain.block() == 0
    clock.advance(11.99)
    assert chain.block() == 0
    clock.advance(0.02)
    assert chain.block() == 1
    clock.advance(12 * 99)
    assert chain.block() == 100
    assert (chain.block_timestamp(100) - genesis).total_seconds() == pytest.approx(1200.0)
    with pytest.raises(ChainError, match="does not exist yet"):
        chain.block_timestamp(101)


def test_every_handle_derives_the_same_block(db_path: Path, clock: FakeClock) -> None:
    clock.advance(12 * 7 + 3)
    first = LocalChain(db_path, NETUID, clock=clock)
    second = open_chain(f"local://{db_path}", netuid=NETUID)  # wall clock: far later
    assert first.block() == 7
    assert second.block() > 7
    same_time = LocalChain(db_path, NETUID, clock=lambda: clock.now)
    assert same_time.block() == first.block()
    for handle in (first, second, same_time):
        handle.close()


def test_a_fast_forward_moves_every_handle_ahead_at_once_and_never_back(
    db_path: Path, clock: FakeClock
) -> None:
    clock.advance(12 * 3 + 5)
    skipper, other = (LocalChain(db_path, NETUID, clock=clock) for _ in range(2))
    assert other.block() == 3  # this handle has read the clock before the skip
    assert skipper.db.fast_forward(40) == 40
    assert other.block() == 40  # read again, not the clock it opened with
    assert 0 <= clock.now - other.block_timestamp(40).timestamp() < 12.0  # block 40 began now
    clock.advance(12.0)
    assert skipper.block() == other.block() == 41  # blocks go on from there
    assert skipper.db.fast_forward(10) == 41  # never backwards
    assert other.block() == 41
    with pytest.raises(ValueError, match="block must be"):
        skipper.db.fast_forward(-1)
    for handle in (skipper, other):
        handle.close()


def test_a_genesis_moved_forward_is_refused(db_path: Path, clock: FakeClock) -> None:
    """Blocks never go back: a genesis time later than the one read is a damaged file."""
    chain = LocalChain(db_path, NETUID, clock=clock)
    with sqlite3.connect(db_path) as conn:
        conn.execute(
            "UPDATE meta SET value = ? WHERE key = 'genesis_time'", (repr(clock.now + 60),)
        )
    with pytest.raises(ChainError, match="genesis time moved"):
        chain.block()
    chain.close()


def test_fast_block_time_advances_in_real_time(tmp_path: Path) -> None:
    path = tmp_path / "fast.db"
    create_local_chain(path, 1, block_time=0.1)
    with LocalChain(path, 1) as chain:
        start = chain.block()
        time.sleep(0.35)
        assert chain.block() - start >= 3


def test_block_time_is_fixed_at_creation(db_path: Path, clock: FakeClock) -> None:
    with pytest.raises(ChainError, match="already exists"):
        create_local_chain(db_path, NETUID, block_time=12.0, clock=clock)
    same = create_local_chain(db_path, NETUID, block_time=12.0, exist_ok=True, clock=clock)
    assert same.tempo == 10
    with pytest.raises(ChainError, match="block time"):
        create_local_chain(db_path, NETUID + 1, block_time=1.0, clock=clock)
    other = create_local_chain(db_path, NETUID + 1, block_time=12.0, clock=clock)
    assert other.netuid == NETUID + 1


# -- opening -----------------------------------------------------------------------------------


def test_open_errors_say_what_to_do(tmp_path: Path, db_path: Path) -> None:
    with pytest.raises(ChainError, match="tessera chain create"):
        open_chain(f"local://{tmp_path / 'missing.db'}", netuid=1)
    with pytest.raises(ChainError, match="subnet 99 does not exist"):
        open_chain(f"local://{db_path}", netuid=99)
    with pytest.raises(ChainError, match=r"unsupported chain 'http://example.com': use finney"):
        open_chain("http://example.com", netuid=1)
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not sqlite at all" * 100)
    with pytest.raises(ChainError):
        open_chain(f"local://{junk}", netuid=1)


def test_local_url_forms() -> None:
    assert local_path("local:///tmp/a/chain.db") == Path("/tmp/a/chain.db")
    assert local_path("local://sim/chain.db") == Path("sim/chain.db")
    assert local_path("local:///tmp/with%20space.db") == Path("/tmp/with space.db")
    with pytest.raises(ChainError):
        local_path("local://")
    with pytest.raises(ChainError):
        local_path("local:///x.db?block_time=1")


# -- registration ------------------------------------------------------------------------------


def test_not_registered_message_says_how_to_register(chain: LocalChain) -> None:
    with pytest.raises(NotRegistered) as info:
        chain.commit(CHARLIE, b"hi")
    assert "tessera chain register" in str(info.value)
    assert CHARLIE.ss58_address in str(info.value)
    assert info.value.hotkey == CHARLIE.ss58_address and info.value.netuid == NETUID


def test_registration_rules(db_path: Path, clock: FakeClock) -> None:
    admin = LocalChainDB(db_path, clock=clock)
    with pytest.raises(ChainError, match="already registered"):
        admin.register(NETUID, ALICE.ss58_address)
    with pytest.raises(ValueError):
        admin.register(NETUID, "not-an-address")
    assert admin.register(NETUID, CHARLIE.ss58_address, coldkey=ALICE.ss58_address) == 2
    assert admin.add_stake(NETUID, CHARLIE.ss58_address, 5.0) == 5.0
    with pytest.raises(ChainError, match="cannot unstake"):
        admin.add_stake(NETUID, CHARLIE.ss58_address, -6.0)
    with pytest.raises(ValueError):
        admin.add_stake(NETUID, CHARLIE.ss58_address, math.nan)
    with pytest.raises(NotRegistered):
        admin.add_stake(NETUID, Keypair.create_from_uri("//Eve").ss58_address, 1.0)
    admin.set_validator_permit(NETUID, CHARLIE.ss58_address, True)
    admin.close()


def test_full_subnet_refuses_registration(tmp_path: Path) -> None:
    path = tmp_path / "small.db"
    create_local_chain(path, 1, max_uids=1)
    admin = LocalChainDB(path)
    admin.register(1, ALICE.ss58_address)
    with pytest.raises(ChainError, match="full"):
        admin.register(1, BOB.ss58_address)
    admin.close()


# -- commitments: size and rate limits ---------------------------------------------------------


def test_size_limit_is_one_raw_field(chain: LocalChain) -> None:
    assert chain.commit(BOB, b"").data == b""
    assert chain.commit(BOB, b"\xff" * 128).data == b"\xff" * 128
    with pytest.raises(CommitmentTooLarge):
        chain.commit(BOB, b"\xff" * 129)
    with pytest.raises(TypeError):
        chain.commit(BOB, "text")  # type: ignore[arg-type]


def test_commit_rate_limit_is_a_byte_budget_per_epoch(chain: LocalChain, clock: FakeClock) -> None:
    # tempo 10, netuid 5: epoch = (block + 6) // 11, so blocks 5..15 are epoch 1.
    clock.advance(12 * 5)
    assert chain.block() == 5
    for i in range(31):  # 31 commits of <= 100 bytes cost 100 each: 3100, the whole budget
        chain.commit(BOB, bytes([i]))
    with pytest.raises(RateLimited) as info:
        chain.commit(BOB, b"one too many")
    assert info.value.retry_after_blocks == 11
    chain.commit(ALICE, b"other hotkeys have their own budget")
    clock.advance(12 * 11)
    assert chain.read_commitment(BOB.ss58_address).data == bytes([30])  # type: ignore[union-attr]
    chain.commit(BOB, b"x" * 128)  # next epoch: budget reset; 128 bytes cost 128
    for _ in range(23):
        chain.commit(BOB, b"y" * 128)
    with pytest.raises(RateLimited):
        chain.commit(BOB, b"z")  # 24 * 128 = 3072 used, 100 more would exceed 3100


def test_commitment_records_the_block(chain: LocalChain, clock: FakeClock) -> None:
    clock.advance(12 * 42)
    committed = chain.commit(BOB, b"data")
    assert committed.block == 42
    clock.advance(12 * 3)
    assert chain.read_commitment(BOB.ss58_address).block == 42  # type: ignore[union-attr]


def test_hostile_rows_are_skipped(chain: LocalChain, db_path: Path, clock: FakeClock) -> None:
    chain.commit(BOB, b"good")
    conn = sqlite3.connect(db_path)
    conn.execute(
        "INSERT INTO commitments (netuid, hotkey, data, valid_from) VALUES (?,?,?,?)",
        (NETUID, "not-a-hotkey", b"x", 0),
    )
    conn.execute(
        "INSERT INTO commitments (netuid, hotkey, data, valid_from) VALUES (?,?,?,?)",
        (NETUID, ALICE.ss58_address, b"x" * 500, 0),
    )
    conn.executemany(
        "INSERT INTO weights (netuid, validator_uid, uid, weight, valid_from) VALUES (?,?,?,?,?)",
        [(NETUID, 0, 1, -1.0, 0), (NETUID, 0, 70_000, 1.0, 0), (NETUID, 0, 2, "lots", 0)],
    )
    conn.commit()
    conn.close()
    assert set(chain.read_all_commitments()) == {BOB.ss58_address}
    assert chain.read_commitment(ALICE.ss58_address) is None
    assert chain.read_weights(0) == {}
    clock.advance(12 * 3)
    snapshot = chain.snapshot(0)  # the same rows, read as history, are skipped the same way
    assert set(snapshot.commitments) == {BOB.ss58_address} and snapshot.weights == {}


# -- weights -----------------------------------------------------------------------------------


def test_weights_need_a_validator_permit(chain: LocalChain) -> None:
    with pytest.raises(PermissionDenied, match="validator permit"):
        chain.set_weights(BOB, [0], [1.0], 0)


def test_weights_must_name_registered_uids(chain: LocalChain) -> None:
    with pytest.raises(InvalidWeights, match="not registered"):
        chain.set_weights(ALICE, [1, 7], [1.0, 1.0], 0)


def test_weights_are_normalised_and_replaced(chain: LocalChain) -> None:
    chain.set_weights(ALICE, [0, 1], [2, 6], 0)
    assert chain.read_weights(0) == {0: 0.25, 1: 0.75}
    chain.set_weights(ALICE, [1], [0.5], 0)
    assert chain.read_weights(ALICE.ss58_address) == {1: 1.0}
    assert chain.weights_all() == {0: {1: 1.0}}
    assert chain.read_weights(1) == {}


def test_weights_rate_limit_and_version_key(tmp_path: Path, clock: FakeClock) -> None:
    path = tmp_path / "limited.db"
    create_local_chain(path, 2, weights_rate_limit=3, weights_version_key=7, clock=clock)
    admin = LocalChainDB(path, clock=clock)
    admin.register(2, ALICE.ss58_address, validator=True)
    admin.close()
    with LocalChain(path, 2, clock=clock) as chain:
        with pytest.raises(ChainError, match="version"):
            chain.set_weights(ALICE, [0], [1.0], 6)
        chain.set_weights(ALICE, [0], [1.0], 7)
        clock.advance(12 * 2)
        with pytest.raises(RateLimited) as info:
            chain.set_weights(ALICE, [0], [1.0], 7)
        assert info.value.retry_after_blocks == 1
        clock.advance(12)
        chain.set_weights(ALICE, [0], [1.0], 8)


# -- caller proof ------------------------------------------------------------------------------


def test_a_keypair_must_hold_the_hotkeys_secret(chain: LocalChain) -> None:
    mismatched = Keypair(public_key=BOB.public_key, private_key=CHARLIE.private_key, ss58_format=42)
    with pytest.raises(PermissionDenied, match="signature"):
        chain.commit(mismatched, b"forged")
    with pytest.raises(PermissionDenied):
        chain.set_weights(Keypair(ss58_address=ALICE.ss58_address), [0], [1.0], 0)
    with pytest.raises(TypeError):
        chain.commit(BOB.ss58_address, b"x")
    assert chain.read_commitment(BOB.ss58_address) is None


def test_ed25519_hotkeys_work(chain: LocalChain, db_path: Path, clock: FakeClock) -> None:
    ed = Keypair.create_from_seed("0x" + "11" * 32, crypto_type=KeypairType.ED25519)
    admin = LocalChainDB(db_path, clock=clock)
    admin.register(NETUID, ed.ss58_address)
    admin.close()
    assert chain.commit(ed, b"ed").hotkey == ed.ss58_address


# -- CLI ---------------------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the chain command: other subcommands may belong to modules not written yet."""
    monkeypatch.setattr(commands.cli, "COMMANDS", {"chain": commands.cli.COMMANDS["chain"]})


def test_cli_create_register_stake_show(
    cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "cli.db")
    main = commands.cli.main
    assert main(["chain", "create", "--db", db, "--netuid", "4", "--block-time", "0.2"]) == 0
    assert main(["chain", "create", "--db", db, "--netuid", "4", "--block-time", "0.2"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (
        main(
            [
                "chain",
                "register",
                "--db",
                db,
                "--hotkey",
                ALICE.ss58_address,
                "--validator",
                "--stake",
                "12.5",
            ]
        )
        == 0
    )
    assert main(["chain", "register", "--db", db, "--hotkey", BOB.ss58_address]) == 0
    assert main(["chain", "stake", "--db", db, "--hotkey", BOB.ss58_address, "--amount", "3"]) == 0
    assert "3.0000 TAO" in capsys.readouterr().out
    assert main(["chain", "register", "--db", db, "--hotkey", "garbage"]) == 1
    assert "tessera chain: not an SS58 address" in capsys.readouterr().err

    with LocalChain(db, 4) as chain:
        chain.commit(BOB, b"secret-ish read credentials")
        chain.set_weights(ALICE, [1], [1.0], 0)
    assert main(["chain", "show", "--db", db]) == 0
    shown = capsys.readouterr().out
    assert "metagraph" in shown and "12.5000" in shown and "1:1.000" in shown
    assert "secret-ish" not in shown  # commitments are fingerprinted, never printed

    assert main(["chain", "show", "--db", db, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["netuid"] == 4 and payload["block_time"] == 0.2
    assert [n["stake"] for n in payload["neurons"]] == [12.5, 3.0]
    assert payload["weights"] == {"0": {"1": 1.0}}
    assert payload["commitments"][BOB.ss58_address]["size"] == 27


def test_cli_needs_netuid_when_ambiguous(
    cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "two.db")
    main = commands.cli.main
    assert main(["chain", "create", "--db", db, "--netuid", "1"]) == 0
    assert main(["chain", "create", "--db", db, "--netuid", "2"]) == 0
    assert main(["chain", "register", "--db", db, "--hotkey", ALICE.ss58_address]) == 1
    assert "--netuid" in capsys.readouterr().err
    assert (
        main(["chain", "register", "--db", db, "--netuid", "2", "--hotkey", ALICE.ss58_address])
        == 0
    )
    assert main(["chain", "show", "--db", str(tmp_path / "none.db")]) == 1


def test_cli_register_can_replace_a_uid(
    cli: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = str(tmp_path / "replace.db")
    main = commands.cli.main
    assert main(["chain", "create", "--db", db, "--netuid", "1", "--max-uids", "2"]) == 0
    for key in (ALICE, BOB):
        assert main(["chain", "register", "--db", db, "--hotkey", key.ss58_address]) == 0
    assert main(["chain", "register", "--db", db, "--hotkey", CHARLIE.ss58_address]) == 1
    assert "--replace-uid" in capsys.readouterr().err  # full: the error says what to do
    replace = ["chain", "register", "--db", db, "--hotkey", CHARLIE.ss58_address]
    assert main([*replace, "--replace-uid", "1"]) == 0
    capsys.readouterr()
    assert main(["chain", "show", "--db", db, "--json"]) == 0
    neurons = json.loads(capsys.readouterr().out)["neurons"]
    assert [(n["uid"], n["hotkey"]) for n in neurons] == [
        (0, ALICE.ss58_address),
        (1, CHARLIE.ss58_address),
    ]
    assert {"registered_block", "last_update"} <= set(neurons[1])
