"""Bittensor subtensor as a `Chain`, through substrate-interface.

What it touches on chain (pallet.item); tests/unit/test_chain_metadata.py runs each through the real
substrate-interface against the published finney runtime metadata (docs/chains.md):

- time: `chain_getHeader` (head number, via `get_block_number`), `chain_getBlockHash`,
  `chain_getFinalizedHead`, storage `Timestamp.Now` (milliseconds) at the block's hash.
- metagraph, commitments, weights: the storage reads of `protocol.chain.subtensor_state`, all at
  one block hash (the head for `metagraph()` and the bulk reads, block N's hash for
  `snapshot(N)`, which serves only finalized blocks).
- uids: `SubtensorModule.Uids(netuid, hotkey) -> Option<u16>`.
- commitments: call `Commitments.set_commitment(netuid, info={"fields": [[{"Raw<N>": "0x.."}]]})`
  signed by the hotkey; storage `Commitments.CommitmentOf(netuid, hotkey)` ->
  `Registration {deposit, block, info: {fields}}`.
- weights: call `SubtensorModule.set_weights(netuid, dests, weights, version_key)` with u16
  weights max-upscaled so the largest is 65535; storage `SubtensorModule.Weights(netuid, uid)` ->
  `Vec<(u16, u16)>` (mechanism 0, whose storage index equals the netuid).

The substrate client is injected (any object with substrate-interface's methods): the tests give
it a real `SubstrateInterface` over an in-process node, or a recording fake.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import ValidationError
from scalecodec.exceptions import (
    InvalidScaleTypeValueException,
    MetadataCallFunctionNotFound,
    RemainingScaleBytesNotEmptyException,
)
from substrateinterface import Keypair
from substrateinterface.exceptions import (
    ConfigurationError,
    StorageFunctionNotFound,
    SubstrateRequestException,
)

from protocol.chain.base import Chain
from protocol.chain.errors import (
    BlockNotFinal,
    BlockPruned,
    ChainError,
    ChainUnavailable,
    CommitmentTooLarge,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
)
from protocol.chain.models import (
    MAX_BLOCK,
    MAX_COMMITMENT_BYTES,
    MAX_UID,
    SS58_FORMAT,
    ChainSnapshot,
    Commitment,
    Metagraph,
    canonical_hotkey,
)
from protocol.chain.subtensor_decode import decode_int, decode_weight_pairs, unwrap
from protocol.chain.subtensor_state import SubnetState, commitment_of, read
from protocol.chain.weights import normalise_pairs, to_u16, validate_version_key, validate_weights

log = logging.getLogger(f"tessera.{__name__}")

MAX_TIMESTAMP_MS = 2**63 - 1
ARCHIVE_URL = "wss://archive.chain.opentensor.ai:443"
CALL_TIMEOUT_S = 30.0
"""The websocket's timeout for connecting and for each answer: a node that accepts and then says
nothing fails the call (`ChainUnavailable`, which callers retry) instead of blocking forever."""
"""The public Bittensor archive node (the SDK's `archive` network), for old blocks' state."""
PRUNED_STATE_MARKERS = ("State already discarded", "UnknownBlock", "unknown Block")
"""What a node says when asked for state it no longer keeps (non-archive nodes prune it)."""

# Error names, each a module error of the spec-343 runtime metadata (tests/unit/test_chain_metadata.py
# checks that against tests/support/data/subtensor/), a `DispatchError` variant (`BadOrigin`), or a name of
# subtensor's `CustomTransactionError` (`RateLimitExceeded`).
NOT_REGISTERED_ERRORS = frozenset(
    {
        "AccountNotAllowedCommit",
        "HotKeyNotRegisteredInSubNet",
        "HotKeyNotRegisteredInNetwork",
        "HotKeyAccountNotExists",
    }
)
RATE_LIMIT_ERRORS = frozenset(
    {"SpaceLimitExceeded", "RateLimitExceeded", "SettingWeightsTooFast", "TxRateLimitExceeded"}
)
PERMISSION_ERRORS = frozenset(
    {"NeuronNoValidatorPermit", "NotEnoughStakeToSetWeights", "BadOrigin"}
)
WEIGHT_ERRORS = frozenset(
    {
        "WeightVecNotEqualSize",
        "DuplicateUids",
        "UidVecContainInvalidOne",
        "WeightVecLengthIsLow",
        "MaxWeightExceeded",
        "UidsLengthExceedUidsInSubNet",
    }
)
HINTS = {
    "CommitRevealEnabled": "the subnet requires commit-reveal weights, which this client does not "
    "submit; ask the subnet owner to disable CommitRevealWeightsEnabled",
    "IncorrectWeightVersionKey": "version_key is below the subnet's WeightsVersionKey",
    "MechanismDoesNotExist": "the subnet does not exist",
    "SubnetNotExists": "the subnet does not exist",
}
# `InvalidTransaction::Custom(n)` codes of subtensor's transaction extension that we can act on,
# as numbered by `CustomTransactionError` (subtensor common/src/transaction_error.rs): 1 is
# `StakeAmountTooLow`, what `set_weights` gets below the stake threshold; 19 is `UidNotFound`.
# Other codes surface verbatim.
CUSTOM_TX_ERRORS = {
    1: "NotEnoughStakeToSetWeights",
    6: "RateLimitExceeded",
    10: "HotKeyNotRegisteredInNetwork",
    19: "HotKeyNotRegisteredInSubNet",
}
_CUSTOM_CODE = re.compile(r"custom(?: error)?['\"]?:\s*(\d+)", re.IGNORECASE)
"""A pool rejection's code: `Custom error: 6`, `...with custom error: 6` or `{'Custom': 6}`."""


def redact_url(url: str) -> str:
    """The URL without user info or query (providers put API keys there)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class SubtensorChain(Chain):
    """One subnet of a subtensor chain (finney, testnet or a localnet)."""

    def __init__(
        self,
        url: str,
        netuid: int,
        *,
        substrate: Any | None = None,
        wait_for_finalization: bool = False,
    ) -> None:
        if isinstance(netuid, bool) or not isinstance(netuid, int) or not 0 <= netuid <= MAX_UID:
            raise ValueError(f"netuid must be an integer in [0, {MAX_UID}]")
        self._url = url
        self._netuid = netuid
        self._wait_for_finalization = wait_for_finalization
        if substrate is None:
            substrate = _connect(url)
        self._s = substrate
        self._state = SubnetState(substrate, netuid, self.url)

    @property
    def netuid(self) -> int:
        return self._netuid

    @property
    def url(self) -> str:
        return redact_url(self._url)

    @property
    def substrate(self) -> Any:
        return self._s

    def close(self) -> None:
        closer = getattr(self._s, "close", None)
        if callable(closer):
            with _rpc(self.url):
                closer()

    # -- time ------------------------------------------------------------------------------------

    def block(self) -> int:
        with _rpc(self.url):
            number = self._s.get_block_number(None)
        return read(lambda: decode_int(number, hi=MAX_BLOCK, what="block number"), "head block")

    def block_timestamp(self, block: int) -> datetime:
        _check_block(block)
        with _rpc(self.url):
            block_hash = self._s.get_block_hash(block)
            if not block_hash:
                raise ChainError(f"block {block} does not exist (yet) on {self.url}")
            now = self._s.query("Timestamp", "Now", block_hash=block_hash)
        ms = read(lambda: decode_int(now, hi=MAX_TIMESTAMP_MS, what="timestamp"), "Timestamp.Now")
        try:
            return datetime.fromtimestamp(ms / 1000, tz=UTC)
        except (OverflowError, OSError, ValueError) as exc:
            raise ChainError(f"block {block} carries an impossible timestamp {ms} ms") from exc

    # -- membership ------------------------------------------------------------------------------

    def metagraph(self) -> Metagraph:
        with _rpc(self.url):
            head = self._s.get_chain_head()
            number = self._s.get_block_number(head)
            block = read(lambda: decode_int(number, hi=MAX_BLOCK, what="block"), "head block")
            return self._state.metagraph(head, block)

    def uid_of(self, hotkey: str) -> int | None:
        key = canonical_hotkey(hotkey)
        with _rpc(self.url):
            result = self._s.query("SubtensorModule", "Uids", [self._netuid, key])
        value = unwrap(result)
        if value is None:
            return None
        return read(lambda: decode_int(value, hi=MAX_UID, what="uid"), "Uids")

    def commit_reveal_enabled(self) -> bool:
        """Whether the subnet demands commit-reveal weights (then `set_weights` is refused)."""
        with _rpc(self.url):
            result = self._s.query("SubtensorModule", "CommitRevealWeightsEnabled", [self._netuid])
        return unwrap(result) is True

    # -- commitments -----------------------------------------------------------------------------

    def commit(self, keypair: Keypair, data: bytes) -> Commitment:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise TypeError("commitment data must be bytes")
        blob = bytes(data)
        if len(blob) > MAX_COMMITMENT_BYTES:
            raise CommitmentTooLarge(
                f"commitment is {len(blob)} bytes; one Raw field holds at most "
                f"{MAX_COMMITMENT_BYTES}"
            )
        hotkey = self._require_registered(keypair)
        params = {
            "netuid": self._netuid,
            "info": {"fields": [[{f"Raw{len(blob)}": "0x" + blob.hex()}]]},
        }
        with _rpc(self.url):
            call = self._s.compose_call(
                call_module="Commitments", call_function="set_commitment", call_params=params
            )
        block = self._submit(call, keypair)
        return Commitment(hotkey=hotkey, data=blob, block=block)

    def read_commitment(self, hotkey: str) -> Commitment | None:
        key = canonical_hotkey(hotkey)
        with _rpc(self.url):
            result = self._s.query("Commitments", "CommitmentOf", [self._netuid, key])
        value = unwrap(result)
        if value is None:
            return None
        return commitment_of(key, value)

    def read_all_commitments(self) -> dict[str, Commitment]:
        with _rpc(self.url):
            return self._state.commitments(None)

    # -- weights ---------------------------------------------------------------------------------

    def set_weights(
        self,
        keypair: Keypair,
        uids: Sequence[int],
        weights: Sequence[float],
        version_key: int,
    ) -> None:
        normalised = validate_weights(uids, weights)
        validate_version_key(version_key)
        dests, values = to_u16(normalised)
        self._require_registered(keypair)
        with _rpc(self.url):
            call = self._s.compose_call(
                call_module="SubtensorModule",
                call_function="set_weights",
                call_params={
                    "netuid": self._netuid,
                    "dests": dests,
                    "weights": values,
                    "version_key": version_key,
                },
            )
        self._submit(call, keypair)

    def read_weights(self, validator: int | str) -> dict[int, float]:
        if isinstance(validator, str):
            uid = self.uid_of(validator)
            if uid is None:
                raise NotRegistered(
                    canonical_hotkey(validator), self._netuid, "it has no uid and so no weights"
                )
        elif isinstance(validator, int) and not isinstance(validator, bool):
            if not 0 <= validator <= MAX_UID:
                raise ValueError(f"uid must be in [0, {MAX_UID}]")
            uid = validator
        else:
            raise TypeError("validator must be a uid (int) or a hotkey (str)")
        with _rpc(self.url):
            result = self._s.query("SubtensorModule", "Weights", [self._netuid, uid])
        value = unwrap(result)
        if value is None:
            return {}
        return normalise_pairs(read(lambda: decode_weight_pairs(value), "Weights"))

    def weights_all(self) -> dict[int, dict[int, float]]:
        with _rpc(self.url):
            return self._state.weights(None)

    # -- one block, pinned -----------------------------------------------------------------------

    def snapshot(self, block: int) -> ChainSnapshot:
        """The subnet at finalized block `block` (`Chain.snapshot`): its hash, then every query at
        that hash. `BlockNotFinal` above the finalized head; `BlockPruned` when the node no longer
        keeps that block's state (non-archive nodes keep about the last 256 blocks)."""
        _check_block(block)
        with _rpc(self.url):
            final_hash = self._s.get_chain_finalised_head()
            final_obj = self._s.get_block_number(final_hash)
            final = read(lambda: decode_int(final_obj, hi=MAX_BLOCK, what="block"), "final head")
            if block > final:
                raise BlockNotFinal(
                    f"block {block} is not finalized yet on {self.url} (finalized head: "
                    f"{final}); retry in about {block - final} blocks",
                    block=block,
                    latest_final=final,
                )
            block_hash = self._s.get_block_hash(block)
        if not isinstance(block_hash, str) or not block_hash:
            raise ChainError(f"{self.url} has no hash for finalized block {block}")
        with _state_at(self.url, block):
            metagraph = self._state.metagraph(block_hash, block)
            commitments = self._state.commitments(block_hash)
            weights = self._state.weights(block_hash)
        try:
            return ChainSnapshot(
                block=block,
                block_hash=block_hash,
                metagraph=metagraph,
                commitments=commitments,
                weights=weights,
            )
        except ValidationError as exc:
            raise ChainError(f"{self.url} returned an inconsistent block {block}: {exc}") from exc

    # -- extrinsics ------------------------------------------------------------------------------

    def _require_registered(self, keypair: Keypair) -> str:
        if not isinstance(keypair, Keypair):
            raise TypeError("pass the hotkey's substrateinterface.Keypair")
        hotkey = canonical_hotkey(keypair.ss58_address)
        if self.uid_of(hotkey) is None:
            raise NotRegistered(hotkey, self._netuid, self._register_hint())
        return hotkey

    def _register_hint(self) -> str:
        return (
            f"register it with `btcli subnets register --netuid {self._netuid} "
            f"--network {self.url}` (burns the registration cost from the coldkey)"
        )

    def _submit(self, call: Any, keypair: Keypair) -> int:
        """Sign with the hotkey, submit, wait for inclusion; return the block it landed in."""
        hotkey = canonical_hotkey(keypair.ss58_address)
        with _rpc(self.url):
            try:
                extrinsic = self._s.create_signed_extrinsic(call=call, keypair=keypair)
            except ConfigurationError as exc:  # no private key on the keypair
                raise PermissionDenied(
                    f"cannot sign for hotkey {hotkey}: the keypair holds no private key"
                ) from exc
            try:
                receipt = self._s.submit_extrinsic(
                    extrinsic,
                    wait_for_inclusion=True,
                    wait_for_finalization=self._wait_for_finalization,
                )
            except SubstrateRequestException as exc:
                text = str(exc)[:500]
                raise self._map_error(_request_error_name(text), text, hotkey) from exc
            if not receipt.is_success:
                message = receipt.error_message
                name = message.get("name") if isinstance(message, dict) else None
                raise self._map_error(name, str(message)[:500], hotkey)
            number = getattr(receipt, "block_number", None)
            if not isinstance(number, int) or isinstance(number, bool):
                number = self._s.get_block_number(receipt.block_hash)
        return read(lambda: decode_int(number, hi=MAX_BLOCK, what="block"), "receipt block")

    def _map_error(self, name: str | None, detail: str, hotkey: str) -> ChainError:
        if name in NOT_REGISTERED_ERRORS:
            return NotRegistered(hotkey, self._netuid, self._register_hint())
        if name in RATE_LIMIT_ERRORS:
            return RateLimited(f"{name}: the chain rate-limits this call; retry later")
        if name in PERMISSION_ERRORS:
            return PermissionDenied(
                f"{name}: hotkey {hotkey} may not do this on subnet {self._netuid}"
            )
        if name in WEIGHT_ERRORS:
            return InvalidWeights(f"{name}: the chain rejected the weights")
        hint = HINTS.get(name or "", "")
        return ChainError(f"{name or 'extrinsic failed'}: {hint or detail}")


def _request_error_name(text: str) -> str | None:
    """The error name inside a node's transaction-pool rejection, when we can tell."""
    custom = _CUSTOM_CODE.search(text)
    if custom is not None:
        return CUSTOM_TX_ERRORS.get(int(custom.group(1)))
    for name in (*NOT_REGISTERED_ERRORS, *RATE_LIMIT_ERRORS, *PERMISSION_ERRORS, *HINTS):
        if name in text:
            return name
    return None


def _check_block(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 0 <= block <= MAX_BLOCK:
        raise ValueError("block must be an integer in the u32 range")


@contextmanager
def _rpc(url: str) -> Iterator[None]:
    """Transport failures as `ChainUnavailable`; a runtime without an item or call we use, or bytes
    that do not decode with the runtime's types, as `ChainError`; our own errors pass through."""
    try:
        yield
    except ChainError:
        raise
    except (OSError, TimeoutError) as exc:
        raise ChainUnavailable(f"cannot reach {url}: {exc}") from exc
    except (StorageFunctionNotFound, MetadataCallFunctionNotFound) as exc:
        raise ChainError(f"{url} runs a runtime this client does not support: {exc}") from exc
    except (
        RemainingScaleBytesNotEmptyException,
        InvalidScaleTypeValueException,
        ValueError,
    ) as exc:
        raise ChainError(
            f"{url} sent data that does not decode with its runtime metadata: {str(exc)[:300]}"
        ) from exc
    except Exception as exc:
        kind = type(exc).__name__
        if "WebSocket" in kind or "Connection" in kind:
            raise ChainUnavailable(f"cannot reach {url}: {kind}: {str(exc)[:300]}") from exc
        if isinstance(exc, SubstrateRequestException):
            raise ChainError(f"{url} refused the request: {str(exc)[:300]}") from exc
        raise


@contextmanager
def _state_at(url: str, block: int) -> Iterator[None]:
    """`_rpc`, and a node's "state already discarded" answer turned into `BlockPruned`."""
    try:
        with _rpc(url):
            yield
    except ChainError as exc:
        text = f"{exc} {exc.__cause__ or ''}"
        if not any(marker in text for marker in PRUNED_STATE_MARKERS):
            raise
        raise BlockPruned(
            f"{url} no longer keeps the state of block {block}: non-archive (lite) subtensor "
            "nodes keep only about the last 256 blocks. Read the block sooner, or open the "
            f"chain at an archive node ({ARCHIVE_URL}, or your own node run with "
            "--pruning=archive)"
        ) from exc


def _connect(url: str) -> Any:
    from substrateinterface import SubstrateInterface  # heavy import, only for real nodes

    with _rpc(redact_url(url)):
        return SubstrateInterface(
            url=url, ss58_format=SS58_FORMAT, ws_options={"timeout": CALL_TIMEOUT_S}
        )
