"""`SubtensorChain` cross-checked against the official Bittensor SDK (bittensor>=11).

The SDK's dependencies are not ours, so it lives in a separate virtual environment and runs as a
separate process (tests/support/sdk_crosscheck.py). Set it up once:

    python -m venv /tmp/venv-bt && /tmp/venv-bt/bin/pip install 'bittensor>=11.3'
    BITTENSOR_SDK_PYTHON=/tmp/venv-bt/bin/python pytest tests/unit/test_chain_sdk.py

Without `BITTENSOR_SDK_PYTHON` these tests are skipped and say so. What they check, with the SDK's
own code on the same spec-343 metadata:

- every storage key and value of a subnet, built and encoded by the SDK's Rust SCALE codec, reads
  back through our backend (on the real substrate-interface) as the metagraph, commitments and
  weights the SDK wrote;
- our `set_commitment` / `set_weights` call bytes equal the SDK's for the same arguments;
- the SDK's generated catalogs (made from the newer runtime it ships for) still have every storage
  item, call parameter and error name we use;
- our u16 weight quantisation equals the SDK's `normalize`, and our pool-rejection codes name the
  same errors as the SDK's table.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from substrateinterface import Keypair

from protocol.chain.subtensor import (
    CUSTOM_TX_ERRORS,
    HINTS,
    NOT_REGISTERED_ERRORS,
    PERMISSION_ERRORS,
    RATE_LIMIT_ERRORS,
    WEIGHT_ERRORS,
    SubtensorChain,
)
from protocol.chain.weights import to_u16, validate_weights
from tests.support.metadata_node import METADATA_FILE, MetadataNode

SDK_PYTHON = os.environ.get("BITTENSOR_SDK_PYTHON", "")
pytestmark = pytest.mark.skipif(
    not SDK_PYTHON,
    reason="BITTENSOR_SDK_PYTHON is not set: point it at a Python with bittensor>=11 installed "
    "in its own venv (see this file's docstring) to cross-check against the SDK",
)

NETUID = 7
ALICE, BOB, CHARLIE = (Keypair.create_from_uri(u) for u in ("//Alice", "//Bob", "//Charlie"))
HELLO = {"Raw5": "0x68656c6c6f"}
STORAGE: list[list[Any]] = [
    ["SubtensorModule", "NetworksAdded", [NETUID], True],
    ["SubtensorModule", "SubnetworkN", [NETUID], 3],
    *(
        ["SubtensorModule", "Keys", [NETUID, uid], keypair.ss58_address]
        for uid, keypair in enumerate([ALICE, BOB, CHARLIE])
    ),
    ["SubtensorModule", "Uids", [NETUID, ALICE.ss58_address], 0],
    ["SubtensorModule", "ValidatorPermit", [NETUID], [True, False, False]],
    ["SubtensorModule", "LastUpdate", [NETUID], [1100, 40, 900]],
    ["SubtensorModule", "BlockAtRegistration", [NETUID, 2], 950],
    ["SubtensorModule", "TotalHotkeyAlpha", [ALICE.ss58_address, NETUID], 1_500 * 10**9],
    ["SubtensorModule", "Weights", [NETUID, 0], [[1, 65535], [2, 21845]]],
    ["SubtensorModule", "CommitRevealWeightsEnabled", [NETUID], False],
    [
        "Commitments",
        "CommitmentOf",
        [NETUID, BOB.ss58_address],
        {"deposit": 0, "block": 900, "info": {"fields": [[HELLO]]}},
    ],
    ["Timestamp", "Now", [], 1_700_000_000_123],
]
CALLS: list[list[Any]] = [
    ["Commitments", "set_commitment", {"netuid": NETUID, "info": {"fields": [[HELLO]]}}],
    [
        "SubtensorModule",
        "set_weights",
        {"netuid": NETUID, "dests": [1, 3], "weights": [21845, 65535], "version_key": 42},
    ],
]
WEIGHTS = [([3, 1, 2], [0.75, 0.25, 0.0]), ([0, 5, 9], [1e-9, 3.0, 2.0]), ([4], [7.0])]
ERROR_NAMES = sorted(
    NOT_REGISTERED_ERRORS | RATE_LIMIT_ERRORS | PERMISSION_ERRORS | WEIGHT_ERRORS | set(HINTS)
)


@pytest.fixture(scope="module")
def sdk() -> dict[str, Any]:
    request = {
        "metadata": str(METADATA_FILE),
        "storage": STORAGE,
        "calls": CALLS,
        "items": sorted({(p, i) for p, i, _, _ in STORAGE}),
        "errors": ERROR_NAMES,
        "weights": WEIGHTS,
    }
    script = Path(__file__).parents[1] / "support" / "sdk_crosscheck.py"
    done = subprocess.run(
        [SDK_PYTHON, str(script)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    answer: dict[str, Any] = json.loads(done.stdout)
    print(f"bittensor {answer['sdk_version']}, metadata spec {answer['spec_version']}")
    return answer


def test_our_backend_reads_what_the_sdk_wrote(sdk: dict[str, Any]) -> None:
    node = MetadataNode()
    node.storage.update(sdk["state"])
    chain = SubtensorChain("ws://127.0.0.1:9944", NETUID, substrate=node.client())
    metagraph = chain.metagraph()
    assert [
        (n.uid, n.hotkey, n.stake, n.validator_permit, n.registered_block, n.last_update)
        for n in metagraph.neurons
    ] == [
        (0, ALICE.ss58_address, 1500.0, True, 0, 1100),
        (1, BOB.ss58_address, 0.0, False, 0, 40),
        (2, CHARLIE.ss58_address, 0.0, False, 950, 900),
    ]
    assert chain.uid_of(ALICE.ss58_address) == 0
    assert chain.weights_all() == {0: pytest.approx({1: 0.75, 2: 0.25})}
    commitment = chain.read_commitment(BOB.ss58_address)
    assert commitment is not None and (commitment.data, commitment.block) == (b"hello", 900)
    assert chain.commit_reveal_enabled() is False
    node.end_block(100)
    assert chain.block_timestamp(100).timestamp() == 1_700_000_000.123


def test_our_call_bytes_are_the_sdks(sdk: dict[str, Any]) -> None:
    """What our backend submits ends with the SDK's bytes of the same call."""
    node = MetadataNode()
    node.storage.update(sdk["state"])
    chain = SubtensorChain("ws://127.0.0.1:9944", NETUID, substrate=node.client())
    chain.commit(ALICE, b"hello")
    chain.set_weights(ALICE, [3, 1, 2], [0.75, 0.25, 0.0], version_key=42)
    submitted = [call["extrinsic"] for call in node.submitted]
    assert len(submitted) == len(sdk["calls"]) == 2
    for extrinsic, call in zip(submitted, sdk["calls"], strict=True):
        assert extrinsic.endswith(call.removeprefix("0x"))


def test_the_newer_runtime_still_has_what_we_use(sdk: dict[str, Any]) -> None:
    items = sorted({(p, i) for p, i, _, _ in STORAGE})
    missing = [
        item for item, found in zip(items, sdk["newest_value_types"], strict=True) if not found
    ]
    assert missing == []
    assert sdk["newest_call_params"] == [list(params) for _, _, params in CALLS]
    known = set(sdk["known_errors"]) | set(sdk["custom_codes"].values())
    # "NotEnoughStakeToSetWeights" is the module error; the SDK files code 1 as StakeAmountTooLow
    assert sorted(set(ERROR_NAMES) - known) == []
    for code, name in CUSTOM_TX_ERRORS.items():
        sdk_name = sdk["custom_codes"][str(code)]
        assert name == sdk_name or (code, sdk_name) == (1, "StakeAmountTooLow")


def test_our_u16_weights_are_the_sdks(sdk: dict[str, Any]) -> None:
    for (uids, weights), theirs in zip(WEIGHTS, sdk["normalized"], strict=True):
        dests, values = to_u16(validate_weights(uids, weights))
        assert dict(zip(dests, values, strict=True)) == dict(zip(*theirs, strict=True))
