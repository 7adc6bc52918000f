"""`SubtensorChain` against the published finney runtime metadata, through the real client.

Every test here runs our backend on a real `substrateinterface.SubstrateInterface` whose transport
is `MetadataNode` (tests/support/metadata_node.py): the library decodes the spec-343 metadata in
tests/support/data/subtensor/, builds each storage key, encodes each call and signed extrinsic, and
decodes each value, receipt and event. A pallet, storage item, call or argument the runtime does
not have (or of another type, or in another order) fails inside substrate-interface. Values come
from the library's own encoder fed the runtime's types, or from a finney node (recorded by the
Bittensor SDK); the node decodes what we submit with the library as well.
"""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from typing import Any

import pytest
import yaml
from substrateinterface import Keypair

from protocol.chain import (
    BlockNotFinal,
    BlockPruned,
    ChainError,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
)
from protocol.chain.subtensor import (
    HINTS,
    NOT_REGISTERED_ERRORS,
    PERMISSION_ERRORS,
    RATE_LIMIT_ERRORS,
    WEIGHT_ERRORS,
    SubtensorChain,
)
from tests.support.metadata_node import (
    DATA,
    METADATA_FILE,
    SPEC_VERSION,
    MetadataNode,
    block_hash,
    failure,
)

NETUID = 7
ALICE, BOB, CHARLIE = (Keypair.create_from_uri(u) for u in ("//Alice", "//Bob", "//Charlie"))
METADATA_SHA256 = "766458bb64e9e5b771576af92deb980b791b55d7f669b1c4845b6acacffab31a"
NON_MODULE_ERRORS = {"BadOrigin": "a DispatchError variant", "RateLimitExceeded": "custom code 6"}


@pytest.fixture
def node() -> MetadataNode:
    return MetadataNode()


@pytest.fixture
def chain(node: MetadataNode) -> SubtensorChain:
    return SubtensorChain("ws://127.0.0.1:9944", NETUID, substrate=node.client())


def _subnet(node: MetadataNode, netuid: int = NETUID) -> None:
    """//Alice (validator), //Bob and //Charlie on uids 0..2, values encoded by the library."""
    node.put("SubtensorModule", "NetworksAdded", [netuid], True)
    node.put("SubtensorModule", "SubnetworkN", [netuid], 3)
    for uid, keypair in enumerate((ALICE, BOB, CHARLIE)):
        node.put("SubtensorModule", "Keys", [netuid, uid], keypair.ss58_address)
        node.put("SubtensorModule", "Uids", [netuid, keypair.ss58_address], uid)
        node.put("SubtensorModule", "BlockAtRegistration", [netuid, uid], 10 + uid)
    node.put("SubtensorModule", "ValidatorPermit", [netuid], [True, False, False])
    node.put("SubtensorModule", "LastUpdate", [netuid], [1100, 40, 900])
    node.put("SubtensorModule", "TotalHotkeyAlpha", [ALICE.ss58_address, netuid], 1_500 * 10**9)
    node.put("SubtensorModule", "TotalHotkeyAlpha", [BOB.ss58_address, netuid], 2_000_000)


def _registration(block: int, *fields: dict[str, str]) -> dict[str, Any]:
    return {"deposit": 0, "block": block, "info": {"fields": [list(fields)]}}


# -- the data ----------------------------------------------------------------------------------


def test_the_metadata_is_the_published_finney_runtime(node: MetadataNode) -> None:
    assert hashlib.sha256(METADATA_FILE.read_bytes()).hexdigest() == METADATA_SHA256
    version = node.library.get_constant("System", "Version").value
    assert (version["spec_name"], version["spec_version"]) == ("node-subtensor", SPEC_VERSION)
    assert node.library.ss58_format == 42


def test_the_localnet_profile_runs_this_runtime() -> None:
    """The compose `localnet` image is the subtensor release of the metadata checked here."""
    compose = yaml.safe_load((DATA.parents[3] / "docker" / "compose.yml").read_text())
    localnet = compose["services"]["localnet"]
    assert localnet["profiles"] == ["localnet"]
    assert localnet["image"].startswith("ghcr.io/opentensor/subtensor-localnet:v")
    assert localnet["image"].endswith(f"-{SPEC_VERSION}")  # release tags end with the spec
    assert "127.0.0.1:9944:9944" in localnet["ports"]  # loopback only


# -- reads -------------------------------------------------------------------------------------


def test_metagraph_decodes_the_runtime_types(chain: SubtensorChain, node: MetadataNode) -> None:
    _subnet(node)
    metagraph = chain.metagraph()
    assert (metagraph.netuid, metagraph.block) == (NETUID, node.head)
    assert [
        (n.uid, n.hotkey, n.stake, n.validator_permit, n.registered_block, n.last_update)
        for n in metagraph.neurons
    ] == [
        (0, ALICE.ss58_address, 1500.0, True, 10, 1100),
        (1, BOB.ss58_address, 0.002, False, 11, 40),
        (2, CHARLIE.ss58_address, 0.0, False, 12, 900),
    ]
    head = block_hash(node.head)
    reads = [
        (m, p) for m, p in node.requests if m in ("state_getStorageAt", "state_queryStorageAt")
    ]
    assert reads and all(p[-1] == head for _, p in reads)  # every read pinned to one block


def test_a_missing_subnet_is_refused(chain: SubtensorChain) -> None:
    with pytest.raises(ChainError, match="does not exist"):
        chain.metagraph()  # NetworksAdded reads its runtime default, false


def test_uid_of_and_the_commit_reveal_default(chain: SubtensorChain, node: MetadataNode) -> None:
    _subnet(node)
    assert chain.uid_of(CHARLIE.ss58_address) == 2
    assert chain.uid_of(Keypair.create_from_uri("//Dave").ss58_address) is None
    assert chain.commit_reveal_enabled() is True  # the runtime's default for a fresh subnet
    node.put("SubtensorModule", "CommitRevealWeightsEnabled", [NETUID], False)
    assert chain.commit_reveal_enabled() is False


def test_block_timestamp_reads_timestamp_now_at_the_block(
    chain: SubtensorChain, node: MetadataNode
) -> None:
    node.put("Timestamp", "Now", [], 1_700_000_000_123)
    node.end_block(100)
    node.put("Timestamp", "Now", [], 1_800_000_000_000)
    assert chain.block() == node.head
    assert chain.block_timestamp(100) == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    with pytest.raises(ChainError, match="does not exist"):
        chain.block_timestamp(node.head + 1)


def test_commitments_decode_from_registration(chain: SubtensorChain, node: MetadataNode) -> None:
    digest = {"Sha256": "0x" + "ab" * 32}
    node.put("Commitments", "CommitmentOf", [NETUID, ALICE.ss58_address], _registration(5, digest))
    node.put(
        "Commitments",
        "CommitmentOf",
        [NETUID, BOB.ss58_address],
        _registration(6, digest, {"Raw5": "0x68656c6c6f"}),
    )
    full = {"Raw128": "0x" + bytes(range(128)).hex()}
    node.put("Commitments", "CommitmentOf", [NETUID, CHARLIE.ss58_address], _registration(7, full))
    bob = chain.read_commitment(BOB.ss58_address)
    assert bob is not None and (bob.data, bob.block) == (b"hello", 6)
    assert chain.read_commitment(ALICE.ss58_address) is None  # no raw field
    assert chain.read_commitment(Keypair.create_from_uri("//Dave").ss58_address) is None
    everything = chain.read_all_commitments()
    assert {hk: (c.data, c.block) for hk, c in everything.items()} == {
        BOB.ss58_address: (b"hello", 6),
        CHARLIE.ss58_address: (bytes(range(128)), 7),
    }


def test_weights_decode_from_u16_pairs(chain: SubtensorChain, node: MetadataNode) -> None:
    _subnet(node)
    node.put("SubtensorModule", "Weights", [NETUID, 0], [(1, 65535), (2, 21845)])
    node.put("SubtensorModule", "Weights", [NETUID, 1], [])
    assert chain.read_weights(ALICE.ss58_address) == pytest.approx({1: 0.75, 2: 0.25})
    assert chain.read_weights(1) == {}
    assert chain.weights_all() == {0: pytest.approx({1: 0.75, 2: 0.25})}


def test_snapshot_reads_every_item_at_the_blocks_hash(
    chain: SubtensorChain, node: MetadataNode
) -> None:
    _subnet(node)
    node.put("SubtensorModule", "Weights", [NETUID, 0], [(1, 65535)])
    hello = _registration(900, {"Raw5": "0x68656c6c6f"})
    node.put("Commitments", "CommitmentOf", [NETUID, BOB.ss58_address], hello)
    node.end_block(1000)
    node.put("SubtensorModule", "Weights", [NETUID, 0], [(2, 65535)])
    node.put("SubtensorModule", "TotalHotkeyAlpha", [ALICE.ss58_address, NETUID], 1)
    later = _registration(1200, {"Raw3": "0x627965"})
    node.put("Commitments", "CommitmentOf", [NETUID, BOB.ss58_address], later)
    node.requests.clear()
    snapshot = chain.snapshot(1100)
    assert snapshot.block_hash == block_hash(1100)
    assert snapshot.weights == {0: {1: 1.0}}
    assert snapshot.commitments[BOB.ss58_address].data == b"hello"
    assert snapshot.metagraph.neuron(0).stake == 1500.0  # type: ignore[union-attr]
    reads = [
        (m, p) for m, p in node.requests if m in ("state_getStorageAt", "state_queryStorageAt")
    ]
    assert reads and all(p[-1] == block_hash(1100) for _, p in reads)
    assert chain.weights_all() == {0: {2: 1.0}}  # the head moved on


def test_snapshot_refuses_unfinal_and_pruned_blocks(
    chain: SubtensorChain, node: MetadataNode
) -> None:
    _subnet(node)
    with pytest.raises(BlockNotFinal):
        chain.snapshot(node.finalized + 1)
    node.pruned_below = 1000  # a lite node's "State already discarded" error, via the library
    with pytest.raises(BlockPruned, match="archive"):
        chain.snapshot(999)
    assert chain.snapshot(1000).metagraph.n == 3


def test_bytes_that_do_not_decode_are_a_chain_error(
    chain: SubtensorChain, node: MetadataNode
) -> None:
    node.put_raw(node.key("SubtensorModule", "Uids", [NETUID, BOB.ss58_address]), "0x05")
    with pytest.raises(ChainError, match="does not decode"):
        chain.uid_of(BOB.ss58_address)  # one byte for a u16
    _subnet(node)
    node.put_raw(node.key("SubtensorModule", "ValidatorPermit", [NETUID]), "0xff01")
    with pytest.raises(ChainError, match="does not decode"):
        chain.metagraph()


# -- writes ------------------------------------------------------------------------------------


def _args(call: dict[str, Any]) -> dict[str, Any]:
    return {arg["name"]: arg["value"] for arg in call["call"]["call_args"]}


@pytest.mark.parametrize("data", [b"", b"hello", bytes(range(128))])
def test_commit_submits_set_commitment(
    chain: SubtensorChain, node: MetadataNode, data: bytes
) -> None:
    _subnet(node)
    committed = chain.commit(BOB, data)
    (submitted,) = node.submitted
    assert submitted["address"] == BOB.ss58_address
    assert (submitted["call"]["call_module"], submitted["call"]["call_function"]) == (
        "Commitments",
        "set_commitment",
    )
    payload = "0x" + data.hex() if data else []  # the library decodes a [u8; 0] as a list
    assert _args(submitted) == {
        "netuid": NETUID,
        "info": {"fields": [{f"Raw{len(data)}": payload}]},
    }
    assert committed.block == node.head + 1  # the block the receipt names


def test_set_weights_submits_max_upscaled_u16(chain: SubtensorChain, node: MetadataNode) -> None:
    _subnet(node)
    chain.set_weights(ALICE, [3, 1, 2], [0.75, 0.25, 0.0], version_key=2**40)
    (submitted,) = node.submitted
    assert submitted["address"] == ALICE.ss58_address
    assert submitted["call"]["call_module"] == "SubtensorModule"
    assert submitted["call"]["call_function"] == "set_weights"
    # 0.25 / 0.75 of u16::MAX is 21845; zero weights are dropped; the version key is a u64
    assert _args(submitted) == {
        "netuid": NETUID,
        "dests": [1, 3],
        "weights": [21845, 65535],
        "version_key": 2**40,
    }


def _error_pallets(node: MetadataNode) -> dict[str, str]:
    """Each module error name of the runtime, with (the first of) its pallets."""
    found: dict[str, str] = {}
    for pallet in node.library.metadata.pallets:
        for error in pallet.errors or []:
            found.setdefault(error.name, pallet.name)
    return found


EXPECTED = [
    *((name, NotRegistered) for name in sorted(NOT_REGISTERED_ERRORS)),
    *((name, RateLimited) for name in sorted(RATE_LIMIT_ERRORS)),
    *((name, PermissionDenied) for name in sorted(PERMISSION_ERRORS)),
    *((name, InvalidWeights) for name in sorted(WEIGHT_ERRORS)),
    *((name, ChainError) for name in sorted(HINTS)),
]


def test_every_error_name_we_map_is_the_runtimes(node: MetadataNode) -> None:
    module_errors = _error_pallets(node)
    unknown = {n for n, _ in EXPECTED if n not in module_errors and n not in NON_MODULE_ERRORS}
    assert unknown == set()
    assert set(NON_MODULE_ERRORS).isdisjoint(module_errors)
    dispatch_error = node.library.runtime_config.get_decoder_class("sp_runtime::DispatchError")
    assert "BadOrigin" in [name for name, _ in dispatch_error.type_mapping]


def test_failed_extrinsics_map_to_typed_errors(chain: SubtensorChain, node: MetadataNode) -> None:
    """Each error name in a receipt, as the library reads it from a `System.ExtrinsicFailed`."""
    _subnet(node)
    pallets = _error_pallets(node)
    for name, expected in EXPECTED:
        if name == "RateLimitExceeded":
            continue  # no dispatch error: a pool rejection's custom code (see the fake's tests)
        is_module = name not in NON_MODULE_ERRORS
        node.outcome = node.module_error(pallets[name], name) if is_module else failure(name)
        with pytest.raises(expected, match="register" if expected is NotRegistered else name):
            chain.set_weights(ALICE, [1], [1.0], 1)


# -- bytes a finney node sent the Bittensor SDK ------------------------------------------------


def _recorded(item: str) -> list[dict[str, Any]]:
    entries = json.loads((DATA / "sdk-recorded-storage.json").read_text())["entries"]
    return [e for e in entries if e["item"] == item]


def _asked_for(node: MetadataNode, key: str) -> bool:
    return any(key in json.dumps(params) for _, params in node.requests)


@pytest.mark.parametrize(
    ("seed", "uid"), [("get_uid_for_hotkey_on_subnet", 5), ("is_hotkey_registered_on_subnet", 29)]
)
def test_uid_of_builds_the_sdks_key(node: MetadataNode, seed: str, uid: int) -> None:
    (entry,) = (e for e in _recorded("SubtensorModule.Uids") if e["sdk_seed"] == seed)
    node.put_raw(entry["key"], entry["value"])
    chain = SubtensorChain("ws://127.0.0.1:9944", entry["netuid"], substrate=node.client())
    assert chain.uid_of(entry["hotkey"]) == uid
    assert _asked_for(node, entry["key"])


def test_read_commitment_builds_the_sdks_key(node: MetadataNode) -> None:
    (entry,) = _recorded("Commitments.CommitmentOf")
    chain = SubtensorChain("ws://127.0.0.1:9944", entry["netuid"], substrate=node.client())
    assert chain.read_commitment(entry["hotkey"]) is None  # finney had none: `null`
    assert _asked_for(node, entry["key"])


def test_weights_all_reads_the_recorded_map(node: MetadataNode) -> None:
    (entry,) = _recorded("SubtensorModule.Weights")
    node.put_raw(entry["key"], entry["value"])
    chain = SubtensorChain("ws://127.0.0.1:9944", entry["netuid"], substrate=node.client())
    # the key's uid, with its row: one pair (uid 10, u16::MAX), a validator weighing itself
    assert chain.weights_all() == {entry["uid"]: {10: 1.0}}


def test_metagraph_reads_recorded_subnet_state(node: MetadataNode) -> None:
    recorded = [
        *_recorded("SubtensorModule.SubnetworkN"),
        *_recorded("SubtensorModule.LastUpdate"),
        *_recorded("SubtensorModule.NetworksAdded")[:1],
    ]
    for entry in recorded:
        node.put_raw(entry["key"], entry["value"])
    for uid, keypair in enumerate((ALICE, BOB)):
        node.put("SubtensorModule", "Keys", [1, uid], keypair.ss58_address)
    chain = SubtensorChain("ws://127.0.0.1:9944", 1, substrate=node.client())
    metagraph = chain.metagraph()
    assert metagraph.hotkeys == [ALICE.ss58_address, BOB.ss58_address]
    # the SDK's own test: subnetwork_n(1) == 1024 (the query_map was bounded by it), and
    # blocks_since_last_update(1, 0) == 4009702 at head block 6553223
    assert [e.get("sdk_test_asserts") for e in recorded][:2] == [
        "subtensor.subnetwork_n(1) == 1024",
        "subtensor.blocks_since_last_update(1, 0) == 4009702 at head block 6553223",
    ]
    assert metagraph.neuron(0).last_update == 6553223 - 4009702  # type: ignore[union-attr]
    (keys_listing,) = [p for m, p in node.requests if m == "state_getKeysPaged"][:1]
    assert keys_listing[1] == 1000  # page size min(SubnetworkN = 1024, 1000)
