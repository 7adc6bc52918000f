"""`LocalChain.snapshot(block)`: the subnet exactly as of one block, on a real SQLite file.

What is pinned: after block B is final, no write (weights, commitment, registration, replacement,
stake, permit) changes `snapshot(B)`, whichever process writes, however late its transaction
commits, whatever its clock says; the change shows in the snapshot of the block it landed in.
"""

from __future__ import annotations

import multiprocessing
import sqlite3
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from substrateinterface import Keypair

from protocol.chain import BlockNotFinal, ChainError, ChainSnapshot, ChainUnavailable
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.chain.local_history import FINALITY_DEPTH
from tests.support.chain_workers import run_history_writer, run_snapshot_reader, snapshot_digest

NETUID = 4
BLOCK_TIME = 12.0
GENESIS = 1_000_000.0
ALICE = Keypair.create_from_uri("//Alice")  # validator, uid 0
BOB = Keypair.create_from_uri("//Bob")  # miner, uid 1
CHARLIE = Keypair.create_from_uri("//Charlie")  # miner, uid 2
DAVE = Keypair.create_from_uri("//Dave")
EVE = Keypair.create_from_uri("//Eve")


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclass
class World:
    """A subnet whose neurons registered in block 0 and wrote in block 1."""

    path: Path
    clock: FakeClock
    chain: LocalChain
    admin: LocalChainDB

    def at(self, block: int) -> None:
        """Move the clock to the middle of `block`."""
        self.clock.now = GENESIS + (block + 0.5) * BLOCK_TIME

    def reopened(self) -> LocalChain:
        """Another handle (its own connection) on the same file and clock."""
        return LocalChain(self.path, NETUID, clock=self.clock)


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    path = tmp_path / "chain.db"
    clock = FakeClock(GENESIS)
    create_local_chain(path, NETUID, block_time=BLOCK_TIME, tempo=10, clock=clock)
    admin = LocalChainDB(path, clock=clock)
    admin.register(NETUID, ALICE.ss58_address, validator=True, stake=100.0)
    admin.register(NETUID, BOB.ss58_address, stake=1.0)
    admin.register(NETUID, CHARLIE.ss58_address, stake=1.0)
    chain = LocalChain(path, NETUID, clock=clock)
    made = World(path, clock, chain, admin)
    made.at(1)
    chain.commit(BOB, b"bob@1")
    chain.commit(CHARLIE, b"charlie@1")
    chain.set_weights(ALICE, [1, 2], [1.0, 3.0], 0)
    yield made
    chain.close()
    admin.close()


def _contents(snapshot: ChainSnapshot) -> tuple[object, ...]:
    """What a snapshot says about the subnet, without which block it was read at."""
    return snapshot.metagraph.neurons, snapshot.commitments, snapshot.weights


def _head(chain: LocalChain) -> tuple[object, ...]:
    return chain.metagraph().neurons, chain.read_all_commitments(), chain.weights_all()


# -- what a snapshot holds -----------------------------------------------------------------------


def test_a_snapshot_is_the_state_as_of_its_block(world: World) -> None:
    world.at(4)
    snapshot = world.chain.snapshot(2)
    assert (snapshot.block, snapshot.metagraph.block, snapshot.netuid) == (2, 2, NETUID)
    assert [
        (n.uid, n.hotkey, n.stake, n.validator_permit, n.registered_block, n.last_update)
        for n in snapshot.metagraph.neurons
    ] == [
        (0, ALICE.ss58_address, 100.0, True, 0, 1),
        (1, BOB.ss58_address, 1.0, False, 0, 0),
        (2, CHARLIE.ss58_address, 1.0, False, 0, 0),
    ]
    assert {hk: (c.data, c.block) for hk, c in snapshot.commitments.items()} == {
        BOB.ss58_address: (b"bob@1", 1),
        CHARLIE.ss58_address: (b"charlie@1", 1),
    }
    assert snapshot.weights == {0: {1: 0.25, 2: 0.75}}
    assert _contents(snapshot) == _head(world.chain)  # nothing written since block 1
    at_zero = world.chain.snapshot(0)  # before the commitments and weights of block 1
    assert at_zero.commitments == {} and at_zero.weights == {} and at_zero.metagraph.n == 3
    assert at_zero.metagraph.neuron(0).last_update == 0  # type: ignore[union-attr]


def test_block_hash_stand_in_is_deterministic(world: World) -> None:
    world.at(6)
    other = world.reopened()
    assert world.chain.snapshot(3).block_hash == other.snapshot(3).block_hash
    assert world.chain.snapshot(3).block_hash != world.chain.snapshot(4).block_hash
    other.close()


def test_the_last_write_of_a_block_is_its_state(world: World) -> None:
    world.at(5)
    world.chain.commit(BOB, b"first")
    world.chain.commit(BOB, b"second")
    world.chain.set_weights(ALICE, [1], [1.0], 0)
    world.chain.set_weights(ALICE, [2], [1.0], 0)
    world.admin.add_stake(NETUID, BOB.ss58_address, 1.0)
    world.admin.add_stake(NETUID, BOB.ss58_address, 1.0)
    world.at(7)
    snapshot = world.chain.snapshot(5)
    assert snapshot.commitments[BOB.ss58_address].data == b"second"
    assert snapshot.weights == {0: {2: 1.0}}
    assert snapshot.metagraph.neuron(1).stake == 3.0  # type: ignore[union-attr]
    assert _contents(world.chain.snapshot(4)) != _contents(snapshot)


# -- later changes never reach an earlier snapshot -----------------------------------------------

Change = Callable[[World], None]


def _set_weights(w: World) -> None:
    w.chain.set_weights(ALICE, [1], [1.0], 0)


def _commit(w: World) -> None:
    w.chain.commit(BOB, b"bob@5")


def _register(w: World) -> None:
    w.admin.register(NETUID, DAVE.ss58_address, stake=2.0)


def _replace(w: World) -> None:
    w.admin.register(NETUID, EVE.ss58_address, replace_uid=2)


def _stake(w: World) -> None:
    w.admin.add_stake(NETUID, BOB.ss58_address, 5.0)


def _permit(w: World) -> None:
    w.admin.set_validator_permit(NETUID, BOB.ss58_address, True)


def _saw_weights(s: ChainSnapshot) -> bool:
    return s.weights == {0: {1: 1.0}} and s.metagraph.neuron(0).last_update == 5  # type: ignore[union-attr]


def _saw_commit(s: ChainSnapshot) -> bool:
    return s.commitments[BOB.ss58_address].block == 5


def _saw_register(s: ChainSnapshot) -> bool:
    dave = s.metagraph.neuron(3)
    return dave is not None and dave.hotkey == DAVE.ss58_address and dave.registered_block == 5


def _saw_replace(s: ChainSnapshot) -> bool:
    eve = s.metagraph.neuron(2)
    return (
        eve is not None
        and eve.hotkey == EVE.ss58_address
        and (eve.registered_block, eve.last_update, eve.stake) == (5, 0, 0.0)
        and s.weights == {0: {1: 1.0}}  # the weights set for the old uid 2 ended with it
        and CHARLIE.ss58_address in s.commitments  # like subtensor, stale commitments stay
    )


def _saw_stake(s: ChainSnapshot) -> bool:
    return s.metagraph.neuron(1).stake == 6.0  # type: ignore[union-attr]


def _saw_permit(s: ChainSnapshot) -> bool:
    return s.metagraph.neuron(1).validator_permit  # type: ignore[union-attr]


CHANGES: list[tuple[str, Change, Callable[[ChainSnapshot], bool]]] = [
    ("weights set", _set_weights, _saw_weights),
    ("commitment changed", _commit, _saw_commit),
    ("new registration", _register, _saw_register),
    ("uid replaced", _replace, _saw_replace),
    ("stake changed", _stake, _saw_stake),
    ("validator permit changed", _permit, _saw_permit),
]


@pytest.mark.parametrize(("change", "seen"), [c[1:] for c in CHANGES], ids=[c[0] for c in CHANGES])
def test_a_later_change_leaves_earlier_snapshots_alone(
    world: World, change: Change, seen: Callable[[ChainSnapshot], bool]
) -> None:
    world.at(4)
    pinned = world.chain.snapshot(2)
    world.at(5)
    change(world)  # lands in block 5
    world.at(9)
    other = world.reopened()
    for handle in (world.chain, other):
        assert handle.snapshot(2) == pinned
        assert _contents(handle.snapshot(4)) == _contents(pinned)
        later = handle.snapshot(5)
        assert seen(later) and not seen(pinned)
        assert _contents(later) == _contents(handle.snapshot(7)) == _head(handle)
    other.close()


def test_replacing_a_validator_ends_its_weights(world: World) -> None:
    world.at(5)
    world.admin.register(NETUID, EVE.ss58_address, validator=True, replace_uid=0)
    world.at(8)
    assert world.chain.snapshot(4).weights == {0: {1: 0.25, 2: 0.75}}
    after = world.chain.snapshot(5)
    assert after.weights == {}
    assert after.metagraph.neuron(0).hotkey == EVE.ss58_address  # type: ignore[union-attr]
    assert world.chain.uid_of(ALICE.ss58_address) is None
    world.at(9)
    assert world.admin.register(NETUID, ALICE.ss58_address) == 3  # back, as a new neuron
    world.at(12)
    alice = world.chain.snapshot(9).metagraph.neuron(3)
    assert alice is not None and (alice.registered_block, alice.last_update) == (9, 0)


def test_replace_uid_needs_a_registered_uid(world: World) -> None:
    with pytest.raises(ChainError, match="not registered"):
        world.admin.register(NETUID, EVE.ss58_address, replace_uid=9)


# -- finality ------------------------------------------------------------------------------------


def test_a_block_that_is_not_final_raises(world: World) -> None:
    world.at(10)
    for block in (9, 10, 11, 10_000):
        with pytest.raises(BlockNotFinal, match="not final") as info:
            world.chain.snapshot(block)
        assert (info.value.block, info.value.latest_final) == (block, 10 - FINALITY_DEPTH)
    assert world.chain.snapshot(10 - FINALITY_DEPTH).block == 8
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError):
            world.chain.snapshot(bad)  # type: ignore[arg-type]


def test_a_block_before_the_subnet_raises(tmp_path: Path) -> None:
    path = tmp_path / "late.db"
    clock = FakeClock(GENESIS)
    create_local_chain(path, 1, block_time=BLOCK_TIME, clock=clock)
    clock.now += 5 * BLOCK_TIME
    create_local_chain(path, 2, block_time=BLOCK_TIME, clock=clock)  # subnet 2 from block 5
    clock.now += 5 * BLOCK_TIME
    with LocalChain(path, 2, clock=clock) as chain:
        with pytest.raises(ChainError, match="did not exist"):
            chain.snapshot(4)
        assert chain.snapshot(5).metagraph.n == 0


# -- the seal: no write lands in a block once it has been read ------------------------------------


def test_a_lagging_writer_cannot_land_in_a_snapshotted_block(world: World) -> None:
    world.at(10)
    pinned = world.chain.snapshot(8)
    lagging = FakeClock(world.clock.now - 3 * BLOCK_TIME)  # its clock says block 7
    late = LocalChain(world.path, NETUID, clock=lagging)
    late_admin = LocalChainDB(world.path, clock=lagging)
    writes: list[Callable[[], object]] = [
        lambda: late.commit(BOB, b"backdated"),
        lambda: late.set_weights(ALICE, [1], [1.0], 0),
        lambda: late_admin.register(NETUID, DAVE.ss58_address),
        lambda: late_admin.register(NETUID, EVE.ss58_address, replace_uid=2),
        lambda: late_admin.add_stake(NETUID, BOB.ss58_address, 1.0),
        lambda: late_admin.set_validator_permit(NETUID, BOB.ss58_address, True),
    ]
    for write in writes:
        with pytest.raises(ChainUnavailable, match="already final"):
            write()
    assert world.chain.snapshot(8) == pinned
    lagging.now += 2 * BLOCK_TIME  # block 9: past the seal, accepted
    assert late.commit(BOB, b"in block 9").block == 9
    assert world.chain.snapshot(8) == pinned
    world.at(11)
    assert world.chain.snapshot(9).commitments[BOB.ss58_address].data == b"in block 9"
    late.close()
    late_admin.close()


def test_a_clock_that_steps_back_cannot_reorder_history(world: World) -> None:
    world.at(6)
    world.chain.commit(BOB, b"at 6")
    world.at(3)  # the clock steps back, before any snapshot of blocks 3..6
    assert world.chain.commit(BOB, b"after 6").block == 6
    world.at(9)
    assert world.chain.snapshot(5).commitments[BOB.ss58_address].data == b"bob@1"
    assert world.chain.snapshot(6).commitments[BOB.ss58_address].data == b"after 6"


class StallingClock:
    """The writer's clock: stamps its block, then holds the write (and the lock) until released."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.armed = False
        self.stamped = threading.Event()
        self.release = threading.Event()

    def __call__(self) -> float:
        now = self.world.clock.now
        if self.armed:
            self.armed = False
            self.stamped.set()
            self.release.wait(timeout=10)
        return now


def test_a_snapshot_waits_for_a_write_in_flight(world: World) -> None:
    world.at(5)
    clock = StallingClock(world)
    writer = LocalChain(world.path, NETUID, clock=clock)
    landed: list[object] = []
    clock.armed = True
    thread = threading.Thread(target=lambda: landed.append(writer.commit(BOB, b"slow")))
    thread.start()
    assert clock.stamped.wait(timeout=10)  # stamped block 5, not committed yet
    world.at(9)  # block 5 is final now
    threading.Timer(0.3, clock.release.set).start()
    pinned = world.chain.snapshot(5)  # must wait for the write, then see it
    thread.join(timeout=10)
    assert [c.block for c in landed] == [5]  # type: ignore[attr-defined]
    assert pinned.commitments[BOB.ss58_address].data == b"slow"
    assert world.chain.snapshot(5) == pinned
    writer.close()


# -- schema --------------------------------------------------------------------------------------


def test_an_old_chain_file_is_refused_with_a_way_out(tmp_path: Path) -> None:
    path = tmp_path / "v1.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    conn.execute("INSERT INTO meta VALUES ('schema_version', '1')")
    conn.execute("CREATE TABLE neurons (netuid INTEGER, uid INTEGER, hotkey TEXT)")
    conn.commit()
    conn.close()
    for open_it in (
        lambda: LocalChainDB(path),
        lambda: create_local_chain(path, 1, exist_ok=True),
    ):
        with pytest.raises(ChainError, match=r"schema version '1'.*tessera chain create"):
            open_it()


# -- several processes ---------------------------------------------------------------------------


def test_processes_agree_on_every_snapshot_while_another_writes(tmp_path: Path) -> None:
    db = tmp_path / "chain.db"
    create_local_chain(db, NETUID, block_time=0.05, tempo=50, commit_max_space=10**9)
    admin = LocalChainDB(db)
    admin.register(NETUID, ALICE.ss58_address, validator=True, stake=10.0)
    miner_uris = ["//Bob", "//Charlie"]
    for uri in miner_uris:
        admin.register(NETUID, Keypair.create_from_uri(uri).ss58_address, stake=1.0)
    first_block = admin.block()
    admin.close()
    spec = {
        "db": str(db),
        "netuid": NETUID,
        "validator_uri": "//Alice",
        "miner_uris": miner_uris,
        "miner_uids": [1, 2],
        "first_block": first_block,
    }
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    barrier = ctx.Barrier(3)
    procs = [
        ctx.Process(target=run_history_writer, args=({**spec, "seconds": 2.5}, results, barrier)),
        *(
            ctx.Process(
                target=run_snapshot_reader, args=({**spec, "seconds": 3.0}, results, barrier)
            )
            for _ in range(2)
        ),
    ]
    for proc in procs:
        proc.start()
    outs = [results.get(timeout=120) for _ in procs]
    for proc in procs:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    for out in outs:
        assert out["problems"] == [], out["problems"]
    (writer,) = [o for o in outs if o["role"] == "writer"]
    first, second = (o["digests"] for o in outs if o["role"] == "reader")
    common = sorted(set(first) & set(second))
    assert writer["writes"] >= 50 and len(common) >= 20
    assert all(first[b] == second[b] for b in common)
    with LocalChain(db, NETUID) as chain:
        assert all(snapshot_digest(chain.snapshot(b)) == first[b] for b in common)
        changed = _contents(chain.snapshot(common[0])) != _contents(chain.snapshot(common[-1]))
    assert changed  # the writer's changes happened during the blocks the readers pinned
