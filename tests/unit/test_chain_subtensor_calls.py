"""`SubtensorChain` on a recording fake of the substrate client: hostile values and error paths.

A recording fake (tests/support/fake_substrate.py) stands in for `substrateinterface.SubstrateInterface`:
it logs every method call with its arguments and answers with canned SCALE-decoded shapes (as
py-substrate-interface and the Bittensor SDK's decoder produce them), including malformed ones a
hostile node could cause. The pallet, item and call names asserted here are checked against the
runtime itself by tests/unit/test_chain_metadata.py (the real client on the finney metadata).
"""

from __future__ import annotations

import contextlib
import inspect
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from substrateinterface import Keypair, SubstrateInterface
from substrateinterface.exceptions import StorageFunctionNotFound, SubstrateRequestException
from websocket import WebSocketConnectionClosedException

from protocol.chain import (
    ChainError,
    ChainUnavailable,
    CommitmentTooLarge,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
)
from protocol.chain.subtensor import SubtensorChain, redact_url
from protocol.chain.subtensor_decode import (
    decode_account,
    decode_bool_list,
    decode_registration,
    decode_weight_pairs,
)
from protocol.chain.weights import normalise_pairs, to_u16, validate_weights
from tests.support.fake_substrate import (
    ALICE,
    BOB,
    CHARLIE,
    HEAD,
    FakeSubstrate,
    Receipt,
    seed_subnet,
)

NETUID = 7


def _registered(fake: FakeSubstrate, *keypairs: Keypair) -> None:
    for uid, keypair in enumerate(keypairs):
        fake.storage[("SubtensorModule", "Uids", (NETUID, keypair.ss58_address))] = uid


@pytest.fixture
def fake() -> FakeSubstrate:
    f = FakeSubstrate()
    _registered(f, ALICE, BOB)
    return f


@pytest.fixture
def chain(fake: FakeSubstrate) -> SubtensorChain:
    return SubtensorChain("wss://user:pw@node.example:443/ws?apikey=s3cret", NETUID, substrate=fake)


def test_the_fake_has_the_real_client_signatures() -> None:
    """Every fake method exists on SubstrateInterface and takes parameters of the same names."""
    for name, method in inspect.getmembers(FakeSubstrate, inspect.isfunction):
        if name.startswith("_") or name in ("named", "end_block"):
            continue
        real = inspect.signature(getattr(SubstrateInterface, name)).parameters
        ours = inspect.signature(method).parameters
        assert set(ours) <= set(real), (name, set(ours) - set(real))


# -- time --------------------------------------------------------------------------------------


def test_block_reads_the_head_header(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    assert chain.block() == 1234
    assert fake.calls == [("get_block_number", {"block_hash": None})]


def test_block_timestamp_reads_timestamp_now_at_the_block_hash(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    block_hash = f"0x{100:064x}"
    fake.storage[("Timestamp", "Now", ())] = 1_700_000_000_123
    assert chain.block_timestamp(100) == datetime(2023, 11, 14, 22, 13, 20, 123000, tzinfo=UTC)
    assert fake.calls == [
        ("get_block_hash", {"block_id": 100}),
        (
            "query",
            {
                "module": "Timestamp",
                "storage_function": "Now",
                "params": None,
                "block_hash": block_hash,
            },
        ),
    ]
    with pytest.raises(ChainError, match="does not exist"):
        chain.block_timestamp(5000)
    fake.storage[("Timestamp", "Now", ())] = -5
    with pytest.raises(ChainError, match="malformed"):
        chain.block_timestamp(100)


# -- metagraph ---------------------------------------------------------------------------------


def test_metagraph_reads_one_block_of_subtensor_module_storage(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    seed_subnet(fake, NETUID)
    metagraph = chain.metagraph()
    assert metagraph.block == 1234 and metagraph.netuid == NETUID
    assert [
        (n.uid, n.hotkey, n.stake, n.validator_permit, n.registered_block, n.last_update)
        for n in metagraph.neurons
    ] == [
        (0, ALICE.ss58_address, 1500.0, True, 10, 1100),
        (1, BOB.ss58_address, 0.002, False, 40, 40),
        (2, CHARLIE.ss58_address, 0.0, False, 950, 900),
    ]
    queries = [
        (q["module"], q["storage_function"], q["params"], q["block_hash"])
        for q in fake.named("query")
    ]
    assert queries == [
        ("SubtensorModule", "NetworksAdded", [NETUID], HEAD),
        ("SubtensorModule", "SubnetworkN", [NETUID], HEAD),
        ("SubtensorModule", "ValidatorPermit", [NETUID], HEAD),
        ("SubtensorModule", "LastUpdate", [NETUID], HEAD),
    ]
    assert fake.named("query_map") == [
        {
            "module": "SubtensorModule",
            "storage_function": item,
            "params": [NETUID],
            "block_hash": HEAD,
            "max_results": 3,
            "page_size": 3,
        }
        for item in ("Keys", "BlockAtRegistration")
    ]
    assert [k["params"] for k in fake.named("create_storage_key")] == [
        [ALICE.ss58_address, NETUID],
        [BOB.ss58_address, NETUID],
        [CHARLIE.ss58_address, NETUID],
    ]
    assert {k["storage_function"] for k in fake.named("create_storage_key")} == {"TotalHotkeyAlpha"}
    assert [q["block_hash"] for q in fake.named("query_multi")] == [HEAD]


def test_metagraph_refuses_a_missing_subnet_and_lying_sizes(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    with pytest.raises(ChainError, match="does not exist"):
        chain.metagraph()
    seed_subnet(fake, NETUID)
    fake.storage[("SubtensorModule", "SubnetworkN", (NETUID,))] = 70_000
    with pytest.raises(ChainError, match="malformed SubnetworkN"):
        chain.metagraph()


def test_metagraph_skips_malformed_entries(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    seed_subnet(fake, NETUID)
    fake.maps[("SubtensorModule", "Keys", (NETUID,))] += [(1, "junk"), ("x", ALICE.ss58_address)]
    fake.storage[("SubtensorModule", "SubnetworkN", (NETUID,))] = 5
    fake.storage[("SubtensorModule", "ValidatorPermit", (NETUID,))] = [True]
    metagraph = chain.metagraph()
    assert metagraph.hotkeys == [ALICE.ss58_address, BOB.ss58_address, CHARLIE.ss58_address]
    assert [n.validator_permit for n in metagraph.neurons] == [True, False, False]
    fake.maps[("SubtensorModule", "Keys", (NETUID,))] += [(3, ALICE.ss58_address)]
    fake.storage[("SubtensorModule", "SubnetworkN", (NETUID,))] = 6
    with pytest.raises(ChainError, match="inconsistent"):
        chain.metagraph()  # the same hotkey on two uids


def test_metagraph_new_fields_are_checked(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    seed_subnet(fake, NETUID)
    fake.storage[("SubtensorModule", "LastUpdate", (NETUID,))] = [7]  # short: the rest read 0
    fake.maps[("SubtensorModule", "BlockAtRegistration", (NETUID,))] = [(0, 2**40), (1, "x")]
    assert [(n.registered_block, n.last_update) for n in chain.metagraph().neurons] == [
        (0, 7),
        (0, 0),
        (0, 0),
    ]
    fake.storage[("SubtensorModule", "LastUpdate", (NETUID,))] = [2**40]
    with pytest.raises(ChainError, match="malformed LastUpdate"):
        chain.metagraph()


def test_uid_of_reads_uids(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    assert chain.uid_of(BOB.ss58_address) == 1
    assert chain.uid_of(CHARLIE.ss58_address) is None
    assert [(q["module"], q["storage_function"], q["params"]) for q in fake.named("query")] == [
        ("SubtensorModule", "Uids", [NETUID, BOB.ss58_address]),
        ("SubtensorModule", "Uids", [NETUID, CHARLIE.ss58_address]),
    ]


# -- commitments -------------------------------------------------------------------------------


def test_commit_calls_set_commitment_with_one_raw_field(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    fake.receipt = Receipt(block_number=None)
    committed = chain.commit(BOB, b"hello")
    assert committed.data == b"hello" and committed.hotkey == BOB.ss58_address
    assert committed.block == 999  # looked up from the receipt's block hash
    assert fake.named("compose_call") == [
        {
            "call_module": "Commitments",
            "call_function": "set_commitment",
            "call_params": {"netuid": NETUID, "info": {"fields": [[{"Raw5": "0x68656c6c6f"}]]}},
        }
    ]
    (signed,) = fake.named("create_signed_extrinsic")
    assert signed["keypair"] is BOB and signed["call"] == {
        "call": ("Commitments", "set_commitment")
    }
    (submitted,) = fake.named("submit_extrinsic")
    assert submitted["wait_for_inclusion"] is True and submitted["wait_for_finalization"] is False
    assert fake.named("get_block_number") == [{"block_hash": fake.receipt.block_hash}]


def test_commit_checks_size_and_registration_first(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    with pytest.raises(CommitmentTooLarge):
        chain.commit(BOB, b"x" * 129)
    with pytest.raises(NotRegistered, match="btcli subnets register --netuid 7"):
        chain.commit(CHARLIE, b"x")
    assert fake.named("compose_call") == []
    assert "s3cret" not in str(chain.url) and chain.url == "wss://node.example:443/ws"


def test_commit_empty_and_full(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    fake.receipt = Receipt(block_number=77)
    chain.commit(ALICE, b"")
    chain.commit(ALICE, bytes(128))
    fields = [c["call_params"]["info"]["fields"] for c in fake.named("compose_call")]
    assert fields == [[[{"Raw0": "0x"}]], [[{"Raw128": "0x" + "00" * 128}]]]


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        ("SpaceLimitExceeded", RateLimited),
        ("AccountNotAllowedCommit", NotRegistered),
        ("TooManyFieldsInCommitmentInfo", ChainError),
    ],
)
def test_commit_failures_map_to_typed_errors(
    chain: SubtensorChain, fake: FakeSubstrate, error: str, expected: type[Exception]
) -> None:
    fake.receipt = Receipt(is_success=False, error_message={"type": "Module", "name": error})
    with pytest.raises(expected):
        chain.commit(BOB, b"data")


def test_read_commitment_reads_commitment_of(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    fake.storage[("Commitments", "CommitmentOf", (NETUID, BOB.ss58_address))] = {
        "deposit": 0,
        "block": 321,
        "info": {"fields": [{"Raw5": "0x68656c6c6f"}]},
    }
    got = chain.read_commitment(BOB.ss58_address)
    assert got is not None and (got.data, got.block) == (b"hello", 321)
    assert chain.read_commitment(ALICE.ss58_address) is None
    assert [(q["module"], q["storage_function"], q["params"]) for q in fake.named("query")] == [
        ("Commitments", "CommitmentOf", [NETUID, BOB.ss58_address]),
        ("Commitments", "CommitmentOf", [NETUID, ALICE.ss58_address]),
    ]


@pytest.mark.parametrize(
    "registration",
    [
        {"block": 1, "info": {"fields": [{"Raw5": "0x68656c6c"}]}},  # length lies
        {"block": 1, "info": {"fields": [{"BigRaw": "0x" + "00" * 300}]}},
        {"block": 1, "info": {"fields": [{"Sha256": "0x" + "00" * 32}]}},
        {"block": 1, "info": {"fields": []}},
        {"block": -1, "info": {"fields": [{"Raw1": "0x00"}]}},
        {"block": 2**40, "info": {"fields": [{"Raw1": "0x00"}]}},
        {"block": 1, "info": {"fields": [{"Raw1": "0xzz"}]}},
        {"block": 1, "info": "garbage"},
        "garbage",
        {"block": 1, "info": {"fields": [{"Raw200": "0x" + "00" * 200}]}},
    ],
)
def test_malformed_commitments_read_as_none(
    chain: SubtensorChain, fake: FakeSubstrate, registration: object
) -> None:
    fake.storage[("Commitments", "CommitmentOf", (NETUID, BOB.ss58_address))] = registration
    assert chain.read_commitment(BOB.ss58_address) is None


def test_read_all_commitments_query_maps_the_subnet(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    fake.maps[("Commitments", "CommitmentOf", (NETUID,))] = [
        (ALICE.ss58_address, {"deposit": 0, "block": 5, "info": {"fields": [{"Raw2": "0x0102"}]}}),
        # the Bittensor SDK's decoder shape: BoundedVec as [[...]], bytes as a nested tuple
        (BOB.ss58_address, {"block": 6, "info": {"fields": [[{"Raw3": ((1, 2, 3),)}]]}}),
        ("not-an-account", {"block": 7, "info": {"fields": [{"Raw1": "0x01"}]}}),
        (CHARLIE.ss58_address, {"block": 8, "info": {"fields": [{"Raw9": "0x01"}]}}),
    ]
    got = chain.read_all_commitments()
    assert {hk: (c.data, c.block) for hk, c in got.items()} == {
        ALICE.ss58_address: (b"\x01\x02", 5),
        BOB.ss58_address: (b"\x01\x02\x03", 6),
    }
    (call,) = fake.named("query_map")
    assert (call["module"], call["storage_function"], call["params"]) == (
        "Commitments",
        "CommitmentOf",
        [NETUID],
    )
    assert call["max_results"] == 65_536


# -- weights -----------------------------------------------------------------------------------


def test_set_weights_sends_max_upscaled_u16(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    fake.receipt = Receipt(block_number=50)
    chain.set_weights(ALICE, [3, 1, 2], [0.75, 0.25, 0.0], version_key=42)
    assert fake.named("compose_call") == [
        {
            "call_module": "SubtensorModule",
            "call_function": "set_weights",
            "call_params": {
                "netuid": NETUID,
                "dests": [1, 3],
                "weights": [21845, 65535],
                "version_key": 42,
            },
        }
    ]
    (signed,) = fake.named("create_signed_extrinsic")
    assert signed["keypair"] is ALICE


def test_set_weights_validates_before_any_call(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    for uids, weights in (([1], [float("nan")]), ([1, 1], [1, 1]), ([1], [0.0]), ([1], [-2])):
        with pytest.raises(InvalidWeights):
            chain.set_weights(ALICE, uids, weights, 1)
    with pytest.raises(InvalidWeights):
        chain.set_weights(ALICE, [1], [1.0], -1)
    with pytest.raises(NotRegistered):
        chain.set_weights(CHARLIE, [1], [1.0], 1)
    assert fake.named("compose_call") == []


@pytest.mark.parametrize(
    ("error", "expected", "message"),
    [
        ("SettingWeightsTooFast", RateLimited, "SettingWeightsTooFast"),
        ("HotKeyNotRegisteredInSubNet", NotRegistered, "register"),
        ("NeuronNoValidatorPermit", PermissionDenied, "NeuronNoValidatorPermit"),
        ("UidVecContainInvalidOne", InvalidWeights, "UidVecContainInvalidOne"),
        ("CommitRevealEnabled", ChainError, "commit-reveal"),
        ("IncorrectWeightVersionKey", ChainError, "WeightsVersionKey"),
    ],
)
def test_set_weights_failures_map_to_typed_errors(
    chain: SubtensorChain, fake: FakeSubstrate, error: str, expected: type[Exception], message: str
) -> None:
    fake.receipt = Receipt(is_success=False, error_message={"type": "Module", "name": error})
    with pytest.raises(expected, match=message):
        chain.set_weights(ALICE, [1], [1.0], 1)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ("Custom error: 6", RateLimited),  # the classic text of a node's 1010 rejection
        ("Invalid transaction with custom error: 1", PermissionDenied),  # stake below threshold
        ({"Custom": 10}, NotRegistered),  # the structured form
        ("custom error: 19", NotRegistered),
    ],
)
def test_pool_rejections_map_to_typed_errors(
    chain: SubtensorChain, fake: FakeSubstrate, data: object, expected: type[Exception]
) -> None:
    rejection = {"code": 1010, "message": "Invalid Transaction", "data": data}
    fake.submit_error = SubstrateRequestException(rejection)
    with pytest.raises(expected):
        chain.set_weights(ALICE, [1], [1.0], 1)


def test_unknown_pool_rejections_surface_verbatim(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    fake.submit_error = SubstrateRequestException({"code": 1010, "data": "Custom error: 99"})
    with pytest.raises(ChainError, match="Custom error: 99"):
        chain.set_weights(ALICE, [1], [1.0], 1)


def test_public_only_keypair_cannot_sign(chain: SubtensorChain) -> None:
    with pytest.raises(PermissionDenied, match="no private key"):
        chain.commit(Keypair(ss58_address=BOB.ss58_address), b"x")


def test_read_weights_reads_weights_and_normalises(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    fake.storage[("SubtensorModule", "Weights", (NETUID, 0))] = [(1, 65535), (2, 21845), (3, 0)]
    assert chain.read_weights(0) == pytest.approx({1: 0.75, 2: 0.25})
    assert chain.read_weights(ALICE.ss58_address) == pytest.approx({1: 0.75, 2: 0.25})
    assert chain.read_weights(1) == {}
    assert [(q["storage_function"], q["params"]) for q in fake.named("query")] == [
        ("Weights", [NETUID, 0]),
        ("Uids", [NETUID, ALICE.ss58_address]),
        ("Weights", [NETUID, 0]),
        ("Weights", [NETUID, 1]),
    ]
    fake.storage[("SubtensorModule", "Weights", (NETUID, 0))] = [(70_000, 1)]
    with pytest.raises(ChainError, match="malformed Weights"):
        chain.read_weights(0)
    with pytest.raises(NotRegistered):
        chain.read_weights(CHARLIE.ss58_address)


def test_weights_all_query_maps_weights(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    fake.maps[("SubtensorModule", "Weights", (NETUID,))] = [
        (0, [(1, 100), (2, 300)]),
        (1, []),
        (2, [[1, 5]]),
        (3, [(1, 99_999)]),  # not a u16: skipped
        (4, "junk"),
    ]
    assert chain.weights_all() == {0: {1: 0.25, 2: 0.75}, 2: {1: 1.0}}
    (call,) = fake.named("query_map")
    assert (call["module"], call["storage_function"], call["params"]) == (
        "SubtensorModule",
        "Weights",
        [NETUID],
    )


# -- transport ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError("refused"),
        BrokenPipeError("pipe"),
        TimeoutError("slow"),
        WebSocketConnectionClosedException("closed"),
    ],
)
def test_transport_failures_are_chain_unavailable(
    chain: SubtensorChain, fake: FakeSubstrate, error: Exception
) -> None:
    fake.query_error = error
    with pytest.raises(ChainUnavailable):
        chain.uid_of(ALICE.ss58_address)


def test_a_runtime_without_our_items_is_a_chain_error(
    chain: SubtensorChain, fake: FakeSubstrate
) -> None:
    fake.query_error = StorageFunctionNotFound('Storage function "SubtensorModule.Uids" not found')
    with pytest.raises(ChainError, match="does not support"):
        chain.uid_of(ALICE.ss58_address)


def test_commit_reveal_flag_and_close(chain: SubtensorChain, fake: FakeSubstrate) -> None:
    fake.storage[("SubtensorModule", "CommitRevealWeightsEnabled", (NETUID,))] = True
    assert chain.commit_reveal_enabled() is True
    chain.close()
    assert fake.calls[-1] == ("close", {})


def test_redact_url() -> None:
    assert redact_url("wss://a:b@host:443/x?token=1#f") == "wss://host:443/x"
    assert redact_url("ws://127.0.0.1:9944") == "ws://127.0.0.1:9944"


# -- properties --------------------------------------------------------------------------------

_junk = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20) | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(_junk)
def test_decoders_reject_junk_with_value_error_only(value: object) -> None:
    for decoder in (decode_registration, decode_weight_pairs, decode_account, decode_bool_list):
        with contextlib.suppress(ValueError):
            decoder(value)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.integers(0, 65_535),
        st.floats(0, 1e6, allow_nan=False, allow_infinity=False),
        min_size=1,
        max_size=50,
    ).filter(lambda d: max(d.values()) > 0)
)
def test_u16_round_trip_keeps_the_distribution(raw: dict[int, float]) -> None:
    normalised = validate_weights(list(raw), list(raw.values()))
    dests, values = to_u16(normalised)
    assert max(values) == 65_535 and dests == sorted(dests)
    back = normalise_pairs(zip(dests, values, strict=True))
    top = max(normalised.values())
    for uid, weight in normalised.items():
        # each u16 value is off by at most half a step of the largest weight
        assert abs(back.get(uid, 0.0) - weight) <= top / 65_535 * len(normalised) + 1e-12
