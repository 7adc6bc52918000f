"""`SubtensorChain.snapshot(block)`: the exact calls, all at one block hash, against the fake.

The fake (tests/support/fake_substrate.py) keeps the state after each recorded block, so these tests also
prove that every read really went to the pinned block: the current state differs from it.
"""

from __future__ import annotations

import pytest
from substrateinterface import Keypair
from substrateinterface.exceptions import SubstrateRequestException

from protocol.chain import BlockNotFinal, BlockPruned, ChainError, ChainUnavailable
from protocol.chain.subtensor import SubtensorChain
from tests.support.fake_substrate import ALICE, BOB, CHARLIE, FakeSubstrate, block_hash, seed_subnet

NETUID = 7
DAVE = Keypair.create_from_uri("//Dave")
EVE = Keypair.create_from_uri("//Eve")


@pytest.fixture
def fake() -> FakeSubstrate:
    return FakeSubstrate()


@pytest.fixture
def chain(fake: FakeSubstrate) -> SubtensorChain:
    return SubtensorChain("wss://node.example:443", NETUID, substrate=fake)


PINNED = 1000
FINAL_HASH = block_hash(1232)


def _commitment(block: int, hex_data: str) -> dict[str, object]:
    return {"deposit": 0, "block": block, "info": {"fields": [{"Raw2": hex_data}]}}


def _history(fake: FakeSubstrate) -> None:
    """The subnet as of block 1000; then every kind of change lands in block 1001."""
    seed_subnet(fake, NETUID)
    fake.maps[("Commitments", "CommitmentOf", (NETUID,))] = [
        (BOB.ss58_address, _commitment(990, "0x0102"))
    ]
    fake.maps[("SubtensorModule", "Weights", (NETUID,))] = [(0, [(1, 100), (2, 300)])]
    fake.end_block(PINNED)
    fake.maps[("SubtensorModule", "Keys", (NETUID,))] = [
        (0, ALICE.ss58_address),
        (1, BOB.ss58_address),
        (2, EVE.ss58_address),  # uid 2 replaced
        (3, DAVE.ss58_address),  # a new registration
    ]
    fake.storage[("SubtensorModule", "SubnetworkN", (NETUID,))] = 4
    fake.storage[("SubtensorModule", "ValidatorPermit", (NETUID,))] = [True, True, False, False]
    fake.storage[("SubtensorModule", "LastUpdate", (NETUID,))] = [1001, 40, 1001, 1001]
    fake.maps[("SubtensorModule", "BlockAtRegistration", (NETUID,))] = [
        (0, 10),
        (1, 40),
        (2, 1001),
        (3, 1001),
    ]
    fake.storage[("SubtensorModule", "TotalHotkeyAlpha", (ALICE.ss58_address, NETUID))] = 5  # stake
    fake.maps[("Commitments", "CommitmentOf", (NETUID,))] = [
        (BOB.ss58_address, _commitment(1001, "0x0304"))
    ]
    fake.maps[("SubtensorModule", "Weights", (NETUID,))] = [(0, [(3, 1)])]
    fake.end_block(PINNED + 1)


def test_snapshot_reads_every_item_at_the_blocks_hash(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    _history(fake)
    snapshot = chain.snapshot(PINNED)
    pinned = block_hash(PINNED)
    assert (snapshot.block, snapshot.block_hash, snapshot.metagraph.block) == (
        PINNED,
        pinned,
        PINNED,
    )
    assert [
        (n.uid, n.hotkey, n.stake, n.validator_permit, n.registered_block, n.last_update)
        for n in snapshot.metagraph.neurons
    ] == [
        (0, ALICE.ss58_address, 1500.0, True, 10, 1100),
        (1, BOB.ss58_address, 0.002, False, 40, 40),
        (2, CHARLIE.ss58_address, 0.0, False, 950, 900),
    ]
    assert {hk: (c.data, c.block) for hk, c in snapshot.commitments.items()} == {
        BOB.ss58_address: (b"\x01\x02", 990)
    }
    assert snapshot.weights == {0: {1: 0.25, 2: 0.75}}
    assert fake.calls[:3] == [
        ("get_chain_finalised_head", {}),
        ("get_block_number", {"block_hash": FINAL_HASH}),
        ("get_block_hash", {"block_id": PINNED}),
    ]
    reads = [
        (name, kw.get("storage_function") or kw.get("storage_name"), kw["block_hash"])
        for name, kw in fake.calls[3:]
        if name != "create_storage_key"
    ]
    assert reads == [
        ("query", "NetworksAdded", pinned),
        ("query", "SubnetworkN", pinned),
        ("query_map", "Keys", pinned),
        ("query", "ValidatorPermit", pinned),
        ("query", "LastUpdate", pinned),
        ("query_map", "BlockAtRegistration", pinned),
        ("query_multi", None, pinned),
        ("query_map", "CommitmentOf", pinned),
        ("query_map", "Weights", pinned),
    ]
    assert [c["params"] for c in fake.named("query_map")] == [[NETUID]] * 4


def test_later_changes_do_not_change_a_snapshot(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    _history(fake)
    before = chain.snapshot(PINNED)
    fake.storage[("SubtensorModule", "TotalHotkeyAlpha", (BOB.ss58_address, NETUID))] = 9
    fake.end_block(PINNED + 2)  # and the head moves on
    assert chain.snapshot(PINNED) == before
    after = chain.snapshot(PINNED + 1)
    assert [n.hotkey for n in after.metagraph.neurons][2:] == [
        EVE.ss58_address,
        DAVE.ss58_address,
    ]
    assert after.metagraph.neuron(2).registered_block == PINNED + 1  # type: ignore[union-attr]
    assert after.metagraph.neuron(0).stake == 5e-9  # type: ignore[union-attr]
    assert after.commitments[BOB.ss58_address].data == b"\x03\x04"
    assert after.weights == {0: {3: 1.0}}
    assert chain.metagraph().n == 4  # the head reads the node's current state


def test_snapshot_refuses_a_block_that_is_not_final(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    _history(fake)
    for block in (1233, 1234, 5000):
        with pytest.raises(BlockNotFinal, match="not finalized") as info:
            chain.snapshot(block)
        assert (info.value.block, info.value.latest_final) == (block, 1232)
    assert fake.named("query") == [] and fake.named("get_block_hash") == []
    assert chain.snapshot(1232).block == 1232
    for bad in (-1, 2**32, True, 1.5):
        with pytest.raises(ValueError):
            chain.snapshot(bad)  # type: ignore[arg-type]


def test_pruned_state_says_to_use_an_archive_node(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    _history(fake)
    fake.pruned_below = 1232 - 256
    with pytest.raises(BlockPruned, match="archive") as info:
        chain.snapshot(PINNED - 100)
    assert "256" in str(info.value) and "--pruning=archive" in str(info.value)
    assert isinstance(info.value, ChainError)
    assert chain.snapshot(PINNED).block == PINNED


def test_snapshot_errors_that_are_not_pruning(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    _history(fake)
    fake.query_error = SubstrateRequestException({"code": 1, "message": "boom"})
    with pytest.raises(ChainError, match="boom") as info:
        chain.snapshot(PINNED)
    assert not isinstance(info.value, BlockPruned)
    fake.query_error = ConnectionRefusedError("refused")
    with pytest.raises(ChainUnavailable):
        chain.snapshot(PINNED)
    fake.query_error = None
    fake.storage[("SubtensorModule", "NetworksAdded", (NETUID,))] = False
    fake.end_block(PINNED - 500)
    with pytest.raises(ChainError, match="does not exist"):
        chain.snapshot(PINNED - 400)
