"""A subtensor node stand-in at the JSON-RPC level, for the real `SubstrateInterface`.

`MetadataNode` answers the JSON-RPC methods py-substrate-interface sends over its websocket with
the published finney runtime metadata (tests/support/data/subtensor/, spec 343) and a storage of raw
SCALE bytes. Hand it to `SubstrateInterface(websocket=node)`: the library then decodes the real
metadata, builds every storage key, encodes every call and signed extrinsic, and decodes every
value and event exactly as against a node, so a wrong pallet, item, call or argument (name, type,
order) fails inside substrate-interface, not inside our own checks.

Values are put in storage as bytes the library encodes from the metadata's own types
(`put`), or as bytes recorded from a real finney node (`put_raw`). Submitted extrinsics are
decoded by the library and kept in `submitted` (with their hex, `extrinsic`); `outcome` is the
events their block records.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scalecodec.base import ScaleBytes
from substrateinterface import SubstrateInterface

DATA = Path(__file__).parent / "data" / "subtensor"
METADATA_FILE = DATA / "finney-spec343-metadata-v14.hex"
SPEC_VERSION = 343
GENESIS = "0x" + "2f" * 32
ZERO_HASH = "0x" + "00" * 32

Events = list[dict[str, Any]]


def block_hash(number: int) -> str:
    """The hash the node gives block `number` (block 0 is the genesis)."""
    return GENESIS if number == 0 else f"0x{number:064x}"


DISPATCH_INFO = {
    "weight": {"ref_time": 1_000_000, "proof_size": 0},
    "class": "Normal",
    "pays_fee": "Yes",
}


def event(pallet: str, name: str, attributes: dict[str, Any]) -> dict[str, Any]:
    """One `EventRecord` of the extrinsic at index 1 (after the timestamp inherent)."""
    return {"phase": {"ApplyExtrinsic": 1}, "event": {pallet: {name: attributes}}, "topics": []}


SUCCESS: Events = [event("System", "ExtrinsicSuccess", {"dispatch_info": DISPATCH_INFO})]


def failure(dispatch_error: Any) -> Events:
    """`System.ExtrinsicFailed` with `dispatch_error` (`"BadOrigin"`, `{"Module": ...}`)."""
    attributes = {"dispatch_error": dispatch_error, "dispatch_info": DISPATCH_INFO}
    return [event("System", "ExtrinsicFailed", attributes)]


@dataclass
class MetadataNode:
    """In-process JSON-RPC node: `send`/`recv`/`close` as a websocket-client connection."""

    head: int = 1234
    finalized: int = 1232
    pruned_below: int = 0
    nonce: int = 0
    outcome: Events = field(default_factory=lambda: SUCCESS)
    storage: dict[str, str] = field(default_factory=dict)
    history: dict[int, dict[str, str]] = field(default_factory=dict)
    submitted: list[dict[str, Any]] = field(default_factory=list)
    requests: list[tuple[str, list[Any]]] = field(default_factory=list)
    _outbox: list[str] = field(default_factory=list)
    _blocks: dict[str, list[str]] = field(default_factory=dict)
    _events: dict[str, str] = field(default_factory=dict)
    _library: SubstrateInterface | None = None

    # -- the substrate client ------------------------------------------------------------------

    def client(self) -> SubstrateInterface:
        """A real `SubstrateInterface` whose only transport is this node."""
        return SubstrateInterface(websocket=self, ss58_format=42, cache_region=_DECODED)

    @property
    def library(self) -> SubstrateInterface:
        """A client of our own, to encode storage values and events from the metadata."""
        if self._library is None:
            self._library = self.client()
            self._library.init_runtime(block_hash=block_hash(self.head))
        return self._library

    # -- state ---------------------------------------------------------------------------------

    def key(self, pallet: str, item: str, params: list[Any] | None = None) -> str:
        return "0x" + self.library.create_storage_key(pallet, item, params or []).data.hex()

    def put(self, pallet: str, item: str, params: list[Any] | None, value: Any) -> None:
        """Store `value` as the library encodes the item's value type from the metadata."""
        function = self.library.get_metadata_storage_function(pallet, item)
        assert function is not None, f"{pallet}.{item} is not in the runtime metadata"
        scale = self.library.runtime_config.create_scale_object(
            function.get_value_type_string(), metadata=self.library.metadata
        )
        self.put_raw(self.key(pallet, item, params), str(scale.encode(value)))

    def put_raw(self, key: str, value: str) -> None:
        self.storage[key] = value

    def end_block(self, number: int) -> None:
        """Record the current storage as the state after block `number` (below the head): a
        query at a block below the head answers from the newest state recorded at or before it,
        a query at the head from the current storage."""
        self.history[number] = copy.deepcopy(self.storage)

    def _state(self, hash_: str | None) -> dict[str, str]:
        number = self._number(hash_) if hash_ else self.head
        if number >= self.head:
            return self.storage
        if number < self.pruned_below:
            raise _RpcError(4003, f"Client error: State already discarded for {hash_}")
        recorded = [b for b in self.history if b <= number]
        return self.history[max(recorded)] if recorded else self.storage

    def _number(self, hash_: str) -> int:
        if hash_ == GENESIS:
            return 0
        number = int(hash_, 16)
        if number > self.head + 1:  # the block of a submitted extrinsic is head + 1
            raise _RpcError(4003, f"unknown Block {hash_}")
        return number

    # -- websocket-client interface -------------------------------------------------------------

    def send(self, payload: str) -> None:
        request = json.loads(payload)
        method, params, rid = request["method"], request.get("params", []), request["id"]
        self.requests.append((method, params))
        try:
            handler = getattr(self, "_rpc_" + method, None)
            if handler is None:
                raise _RpcError(-32601, f"Method not found: {method}")
            result = handler(rid, *params)
        except _RpcError as exc:
            self._reply({"id": rid, "error": {"code": exc.code, "message": exc.message}})
            return
        if result is not _SUBSCRIBED:
            self._reply({"id": rid, "result": result})

    def recv(self) -> str:
        assert self._outbox, "the client waits for an answer the node never sends"
        return self._outbox.pop(0)

    def close(self) -> None:
        return None

    def _reply(self, message: dict[str, Any]) -> None:
        self._outbox.append(json.dumps({"jsonrpc": "2.0", **message}))

    # -- JSON-RPC methods ----------------------------------------------------------------------

    def _rpc_rpc_methods(self, rid: int) -> dict[str, list[str]]:
        names = [n[len("_rpc_") :] for n in dir(self) if n.startswith("_rpc_")]
        return {"methods": sorted(names)}

    def _rpc_system_chain(self, rid: int) -> str:
        return "Bittensor"

    def _rpc_chain_getHead(self, rid: int) -> str:
        return block_hash(self.head)

    def _rpc_chain_getFinalizedHead(self, rid: int) -> str:
        return block_hash(self.finalized)

    def _rpc_chain_getBlockHash(self, rid: int, number: int | None = None) -> str | None:
        if number is None:
            return block_hash(self.head)
        return block_hash(number) if 0 <= number <= self.head else None

    def _rpc_chain_getHeader(self, rid: int, hash_: str | None = None) -> dict[str, Any] | None:
        number = self.head if hash_ is None else self._number(hash_)
        return {
            "parentHash": ZERO_HASH if number == 0 else block_hash(number - 1),
            "number": hex(number),
            "stateRoot": ZERO_HASH,
            "extrinsicsRoot": ZERO_HASH,
            "digest": {"logs": []},
        }

    def _rpc_chain_getBlock(self, rid: int, hash_: str) -> dict[str, Any]:
        return {
            "block": {
                "header": self._rpc_chain_getHeader(rid, hash_),
                "extrinsics": self._blocks.get(hash_, []),
            },
            "justifications": None,
        }

    def _rpc_state_getRuntimeVersion(self, rid: int, hash_: str | None = None) -> dict[str, Any]:
        return {
            "specName": "node-subtensor",
            "implName": "node-subtensor",
            "authoringVersion": 1,
            "specVersion": SPEC_VERSION,
            "implVersion": 1,
            "apis": [],
            "transactionVersion": 1,
            "stateVersion": 1,
        }

    _rpc_chain_getRuntimeVersion = _rpc_state_getRuntimeVersion

    def _rpc_state_getMetadata(self, rid: int, hash_: str | None = None) -> str:
        return _metadata_hex()

    def _rpc_state_getStorageAt(self, rid: int, key: str, hash_: str | None = None) -> str | None:
        if hash_ in self._events and key == self.key("System", "Events"):
            return self._events[hash_]
        return self._state(hash_).get(key)

    _rpc_state_getStorage = _rpc_state_getStorageAt

    def _rpc_state_getKeysPaged(
        self, rid: int, prefix: str, count: int, start: str | None = None, hash_: str | None = None
    ) -> list[str]:
        keys = sorted(k for k in self._state(hash_) if k.startswith(prefix) and k > (start or ""))
        return keys[:count]

    def _rpc_state_queryStorageAt(
        self, rid: int, keys: list[str], hash_: str | None = None
    ) -> list[dict[str, Any]]:
        state = self._state(hash_)
        changes = [[k, state.get(k)] for k in keys]
        return [{"block": hash_ or block_hash(self.head), "changes": changes}]

    def _rpc_system_accountNextIndex(self, rid: int, account: str) -> int:
        return self.nonce

    def _rpc_author_submitAndWatchExtrinsic(self, rid: int, extrinsic: str) -> object:
        decoded = self.library.runtime_config.create_scale_object(
            "Extrinsic", data=ScaleBytes(extrinsic), metadata=self.library.metadata
        )
        decoded.decode()
        call = {**decoded.value, "extrinsic": extrinsic}
        self.submitted.append(call)
        events = self.outcome
        included = block_hash(self.head + 1)
        self._blocks[included] = [_timestamp_inherent(self.library), extrinsic]
        self._events[included] = self._encode_events(events)
        subscription = f"sub-{rid}"
        self._reply({"id": rid, "result": subscription})
        update = {"subscription": subscription, "result": {"inBlock": included}}
        self._reply({"method": "author_extrinsicUpdate", "params": update})
        return _SUBSCRIBED

    def _rpc_author_unwatchExtrinsic(self, rid: int, subscription: str) -> bool:
        return True

    # -- events --------------------------------------------------------------------------------

    def module_error(self, pallet: str, name: str) -> Events:
        """`ExtrinsicFailed` with the module error `pallet.name`, at its index in the metadata."""
        module = self.library.metadata.get_metadata_pallet(pallet)
        index = [e.name for e in module.errors].index(name)
        pallet_index = module.value["index"]
        return failure({"Module": {"index": pallet_index, "error": f"0x{index:02x}000000"}})

    def _encode_events(self, events: Events) -> str:
        function = self.library.get_metadata_storage_function("System", "Events")
        scale = self.library.runtime_config.create_scale_object(
            function.get_value_type_string(), metadata=self.library.metadata
        )
        return str(scale.encode(events))


class _RpcError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _DecodedMetadata:
    """A `cache_region` for substrate-interface: the metadata is decoded once per test session."""

    def __init__(self) -> None:
        self._values: dict[str, Any] = {}

    def get(self, key: str) -> Any:
        return self._values.get(key)

    def set(self, key: str, value: Any) -> None:
        self._values[key] = value


_DECODED = _DecodedMetadata()
_SUBSCRIBED = object()
_metadata_cache: dict[str, str] = {}


def _metadata_hex() -> str:
    if "hex" not in _metadata_cache:
        _metadata_cache["hex"] = METADATA_FILE.read_text().strip()
    return _metadata_cache["hex"]


def _timestamp_inherent(library: SubstrateInterface) -> str:
    call = library.compose_call("Timestamp", "set", {"now": 1_700_000_000_000})
    return str(library.create_unsigned_extrinsic(call).data)
