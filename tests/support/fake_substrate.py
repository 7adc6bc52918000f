"""A recording test double for `substrateinterface.SubstrateInterface` (transport only).

It logs every method call with its arguments and answers with canned SCALE-decoded shapes, so that
tests can assert exactly which pallets, storage items and calls a client uses without a node.

State per block: `storage` / `maps` are the node's current (best-block) state; `end_block(n)`
records a copy of them as the state after block n. A query at block n's hash (`block_hash(n)`)
answers from the newest state recorded at or before n (from the current state when none is), and
raises a lite node's "State already discarded" error for blocks below `pruned_below`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from substrateinterface import Keypair
from substrateinterface.exceptions import ConfigurationError, SubstrateRequestException

HEAD = "0x" + "ab" * 32
ALICE = Keypair.create_from_uri("//Alice")
BOB = Keypair.create_from_uri("//Bob")
CHARLIE = Keypair.create_from_uri("//Charlie")
UNKNOWN_BLOCK_NUMBER = 999
"""What `get_block_number` answers for a hash it did not hand out (e.g. a receipt's)."""

Storage = dict[tuple[str, str, tuple[Any, ...]], Any]
Maps = dict[tuple[str, str, tuple[Any, ...]], list[tuple[Any, Any]]]


def block_hash(number: int) -> str:
    """The hash the fake gives block `number`."""
    return f"0x{number:064x}"


@dataclass
class Obj:
    """What substrate-interface returns from `query`: a ScaleType-like object with `.value`."""

    value: Any


@dataclass
class StorageKey:
    pallet: str
    storage_function: str
    params: list[Any]


@dataclass
class Receipt:
    is_success: bool = True
    error_message: dict[str, Any] | None = None
    block_hash: str = "0x" + "cd" * 32
    block_number: int | None = None


@dataclass
class FakeSubstrate:
    """Records calls; answers from `storage` / `maps` (keys: (module, item, tuple(params)))."""

    head_number: int = 1234
    finalized_number: int = 1232
    storage: Storage = field(default_factory=dict)
    maps: Maps = field(default_factory=dict)
    history: dict[int, tuple[Storage, Maps]] = field(default_factory=dict)
    pruned_below: int = 0
    receipt: Receipt = field(default_factory=Receipt)
    submit_error: Exception | None = None
    query_error: Exception | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _log(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for n, kwargs in self.calls if n == name]

    def end_block(self, number: int) -> None:
        """Record the current storage as the state after block `number`."""
        self.history[number] = (copy.deepcopy(self.storage), copy.deepcopy(self.maps))

    def _number_of(self, hash_: str | None) -> int | None:
        """The block number behind a hash this fake handed out; None for the head or unknown."""
        if hash_ is None or hash_ == HEAD or not hash_.startswith("0x"):
            return None
        number = int(hash_, 16)
        return number if number <= 2**32 else None

    def _state(self, hash_: str | None) -> tuple[Storage, Maps]:
        number = self._number_of(hash_)
        if number is None:
            return self.storage, self.maps
        if number < self.pruned_below:
            raise SubstrateRequestException(
                {
                    "code": 4003,
                    "message": "Client error: Api called for an unknown Block: "
                    f"State already discarded for {hash_}",
                }
            )
        recorded = [b for b in self.history if b <= number]
        return self.history[max(recorded)] if recorded else (self.storage, self.maps)

    def get_chain_head(self) -> str:
        self._log("get_chain_head")
        return HEAD

    def get_chain_finalised_head(self) -> str:
        self._log("get_chain_finalised_head")
        return block_hash(self.finalized_number)

    def get_block_number(self, block_hash: str | None) -> int:
        self._log("get_block_number", block_hash=block_hash)
        if block_hash in (None, HEAD):
            return self.head_number
        number = self._number_of(block_hash)
        return UNKNOWN_BLOCK_NUMBER if number is None else number

    def get_block_hash(self, block_id: int | None = None) -> str | None:
        self._log("get_block_hash", block_id=block_id)
        if block_id is None or block_id > self.head_number:
            return None
        return block_hash(block_id)

    def query(
        self,
        module: str,
        storage_function: str,
        params: list[Any] | None = None,
        block_hash: str | None = None,
    ) -> Obj:
        self._log(
            "query",
            module=module,
            storage_function=storage_function,
            params=params,
            block_hash=block_hash,
        )
        if self.query_error is not None:
            raise self.query_error
        storage, _ = self._state(block_hash)
        return Obj(storage.get((module, storage_function, tuple(params or ()))))

    def query_map(
        self,
        module: str,
        storage_function: str,
        params: list[Any] | None = None,
        block_hash: str | None = None,
        max_results: int | None = None,
        page_size: int = 100,
    ) -> list[tuple[Obj, Obj]]:
        self._log(
            "query_map",
            module=module,
            storage_function=storage_function,
            params=params,
            block_hash=block_hash,
            max_results=max_results,
            page_size=page_size,
        )
        _, maps = self._state(block_hash)
        records = maps.get((module, storage_function, tuple(params or ())), [])
        return [(Obj(k), Obj(v)) for k, v in records[:max_results]]

    def create_storage_key(
        self, pallet: str, storage_function: str, params: list[Any] | None = None
    ) -> StorageKey:
        self._log(
            "create_storage_key", pallet=pallet, storage_function=storage_function, params=params
        )
        return StorageKey(pallet, storage_function, list(params or []))

    def query_multi(
        self, storage_keys: list[StorageKey], block_hash: str | None = None
    ) -> list[tuple[StorageKey, Obj]]:
        self._log("query_multi", storage_keys=storage_keys, block_hash=block_hash)
        storage, _ = self._state(block_hash)
        return [
            (k, Obj(storage.get((k.pallet, k.storage_function, tuple(k.params)), 0)))
            for k in reversed(storage_keys)  # the node answers in its own order
        ]

    def compose_call(
        self, call_module: str, call_function: str, call_params: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        self._log(
            "compose_call",
            call_module=call_module,
            call_function=call_function,
            call_params=call_params,
        )
        return {"call": (call_module, call_function)}

    def create_signed_extrinsic(self, call: Any, keypair: Keypair) -> dict[str, Any]:
        self._log("create_signed_extrinsic", call=call, keypair=keypair)
        if keypair.private_key is None:
            raise ConfigurationError("No private key set to create signatures")
        return {"signed": call, "by": keypair.ss58_address}

    def submit_extrinsic(
        self,
        extrinsic: Any,
        wait_for_inclusion: bool = False,
        wait_for_finalization: bool = False,
    ) -> Receipt:
        self._log(
            "submit_extrinsic",
            extrinsic=extrinsic,
            wait_for_inclusion=wait_for_inclusion,
            wait_for_finalization=wait_for_finalization,
        )
        if self.submit_error is not None:
            raise self.submit_error
        return self.receipt

    def close(self) -> None:
        self._log("close")


def seed_subnet(fake: FakeSubstrate, netuid: int) -> None:
    """A canned subnet: uids 0..2 are //Alice (validator), //Bob and //Charlie, each key in another
    of the account shapes nodes and decoders produce."""
    fake.storage[("SubtensorModule", "NetworksAdded", (netuid,))] = True
    fake.storage[("SubtensorModule", "SubnetworkN", (netuid,))] = 3
    fake.storage[("SubtensorModule", "ValidatorPermit", (netuid,))] = [True, False, False]
    fake.maps[("SubtensorModule", "Keys", (netuid,))] = [
        (0, ALICE.ss58_address),
        (1, "0x" + BOB.public_key.hex()),  # accounts may come back as hex ...
        (2, (tuple(CHARLIE.public_key),)),  # ... or as the SDK decoder's nested tuple
    ]
    fake.storage[("SubtensorModule", "TotalHotkeyAlpha", (ALICE.ss58_address, netuid))] = (
        1_500_000_000_000
    )
    fake.storage[("SubtensorModule", "TotalHotkeyAlpha", (BOB.ss58_address, netuid))] = 2_000_000
    fake.storage[("SubtensorModule", "LastUpdate", (netuid,))] = [1100, 40, 900]
    fake.maps[("SubtensorModule", "BlockAtRegistration", (netuid,))] = [(0, 10), (1, 40), (2, 950)]
