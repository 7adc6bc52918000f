"""A recording test double for `substrateinterface.SubstrateInterface` (transport only).

It logs every method call with its arguments and answers with canned SCALE-decoded shapes, so that
tests can assert exactly which pallets, storage items and calls a client uses without a node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from substrateinterface import Keypair
from substrateinterface.exceptions import ConfigurationError

HEAD = "0x" + "ab" * 32


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
    storage: dict[tuple[str, str, tuple[Any, ...]], Any] = field(default_factory=dict)
    maps: dict[tuple[str, str, tuple[Any, ...]], list[tuple[Any, Any]]] = field(
        default_factory=dict
    )
    stake_items: tuple[str, ...] = ("TotalHotkeyAlpha",)
    receipt: Receipt = field(default_factory=Receipt)
    submit_error: Exception | None = None
    query_error: Exception | None = None
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def _log(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def named(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for n, kwargs in self.calls if n == name]

    def get_chain_head(self) -> str:
        self._log("get_chain_head")
        return HEAD

    def get_block_number(self, block_hash: str | None) -> int:
        self._log("get_block_number", block_hash=block_hash)
        return self.head_number if block_hash in (None, HEAD) else 999

    def get_block_hash(self, block_id: int | None = None) -> str | None:
        self._log("get_block_hash", block_id=block_id)
        if block_id is None or block_id > self.head_number:
            return None
        return f"0x{block_id:064x}"

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
        return Obj(self.storage.get((module, storage_function, tuple(params or ()))))

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
        records = self.maps.get((module, storage_function, tuple(params or ())), [])
        return [(Obj(k), Obj(v)) for k, v in records[:max_results]]

    def get_metadata_storage_function(
        self, module_name: str, storage_name: str, block_hash: str | None = None
    ) -> object | None:
        self._log(
            "get_metadata_storage_function",
            module_name=module_name,
            storage_name=storage_name,
            block_hash=block_hash,
        )
        return object() if storage_name in self.stake_items else None

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
        return [
            (k, Obj(self.storage.get((k.pallet, k.storage_function, tuple(k.params)), 0)))
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
