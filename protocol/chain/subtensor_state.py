"""Reading one subnet's state from subtensor at one block hash: neurons, commitments, weights.

`SubnetState` issues storage queries only (no extrinsics), every one of them at the block hash it
is given, so that the head reads of `SubtensorChain` and its pinned `snapshot(block)` share one
code path. Storage items (pallet.item), all at `block_hash`:

- `SubtensorModule.NetworksAdded(netuid)`, `SubnetworkN(netuid)`, `Keys(netuid, uid)` (query_map),
  `ValidatorPermit(netuid) -> Vec<bool>`, `LastUpdate(netuid) -> Vec<u64>` (mechanism 0, whose
  storage index is the netuid), `BlockAtRegistration(netuid, uid) -> u64` (query_map), and stake
  as `TotalHotkeyAlpha(hotkey, netuid)` (the hotkey's alpha on the subnet; docs/chains.md says
  how that differs from the stake weight subtensor ranks validators by).
- `Commitments.CommitmentOf(netuid, hotkey)` (query_map).
- `SubtensorModule.Weights(netuid, uid) -> Vec<(u16, u16)>` (query_map).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import ValidationError

from protocol.chain.errors import ChainError
from protocol.chain.models import (
    MAX_BLOCK,
    MAX_UID,
    Commitment,
    Metagraph,
    Neuron,
    canonical_hotkey,
)
from protocol.chain.subtensor_decode import (
    decode_account,
    decode_bool_list,
    decode_int,
    decode_int_list,
    decode_registration,
    decode_weight_pairs,
    unwrap,
)
from protocol.chain.weights import normalise_pairs

log = logging.getLogger(f"tessera.{__name__}")

T = TypeVar("T")

RAO_PER_TAO = 1_000_000_000
MAX_COMMITMENT_ENTRIES = 65_536
"""Stale commitments of deregistered hotkeys stay in storage; read at most this many."""
QUERY_MULTI_BATCH = 256
STAKE_ITEM = "TotalHotkeyAlpha"
"""Dynamic-TAO runtimes only (spec 343 has no `TotalHotkeyStake`, the pre-dTAO item)."""


class SubnetState:
    """Storage reads of one subnet at a given block hash (None: the node's best block)."""

    def __init__(self, substrate: Any, netuid: int, url: str) -> None:
        self._s = substrate
        self._netuid = netuid
        self._url = url

    # -- neurons ---------------------------------------------------------------------------------

    def metagraph(self, block_hash: str, block: int) -> Metagraph:
        """Every neuron of the subnet at `block_hash` (whose number is `block`)."""
        netuid = self._netuid
        added = self._query("NetworksAdded", [netuid], block_hash)
        if unwrap(added) is not True:
            raise ChainError(f"subnet {netuid} does not exist on {self._url} at block {block}")
        n_obj = self._query("SubnetworkN", [netuid], block_hash)
        n = read(lambda: decode_int(n_obj, hi=MAX_UID + 1, what="SubnetworkN"), "SubnetworkN")
        keys = self._per_uid_map("Keys", n, block_hash, decode_account)
        permits_obj = self._query("ValidatorPermit", [netuid], block_hash)
        updates_obj = self._query("LastUpdate", [netuid], block_hash)
        registered = self._per_uid_map(
            "BlockAtRegistration",
            n,
            block_hash,
            lambda v: decode_int(v, hi=MAX_BLOCK, what="BlockAtRegistration"),
        )
        stakes = self._stakes(list(keys.values()), block_hash)
        permits = read(lambda: decode_bool_list(permits_obj), "ValidatorPermit")
        updates = read(
            lambda: decode_int_list(updates_obj, hi=MAX_BLOCK, what="LastUpdate"), "LastUpdate"
        )
        try:
            neurons = tuple(
                Neuron(
                    uid=uid,
                    hotkey=hotkey,
                    stake=stakes.get(hotkey, 0) / RAO_PER_TAO,
                    validator_permit=permits[uid] if uid < len(permits) else False,
                    registered_block=registered.get(uid, 0),
                    last_update=updates[uid] if uid < len(updates) else 0,
                )
                for uid, hotkey in sorted(keys.items())
                if uid < n
            )
            return Metagraph(netuid=netuid, block=block, neurons=neurons)
        except ValidationError as exc:
            raise ChainError(f"{self._url} returned an inconsistent metagraph: {exc}") from exc

    def _query(self, item: str, params: list[Any], block_hash: str | None) -> Any:
        return self._s.query("SubtensorModule", item, params, block_hash=block_hash)

    def _per_uid_map(
        self, item: str, n: int, block_hash: str, decode: Callable[[object], T]
    ) -> dict[int, T]:
        """`SubtensorModule.<item>(netuid, uid)` for every uid; malformed entries skipped."""
        out: dict[int, T] = {}
        if n <= 0:
            return out
        records = self._s.query_map(
            "SubtensorModule",
            item,
            [self._netuid],
            block_hash=block_hash,
            max_results=n,
            page_size=min(n, 1000),
        )
        for key, value in records:
            try:
                out[decode_int(key, hi=MAX_UID, what="uid")] = decode(value)
            except ValueError as exc:
                log.warning("skipping malformed %s entry on subnet %d: %s", item, self._netuid, exc)
        return out

    def _stakes(self, hotkeys: list[str], block_hash: str) -> dict[str, int]:
        """Alpha in RAO per hotkey: `TotalHotkeyAlpha(hotkey, netuid)`, in batches."""
        result: dict[str, int] = {}
        for start in range(0, len(hotkeys), QUERY_MULTI_BATCH):
            storage_keys = [
                self._s.create_storage_key("SubtensorModule", STAKE_ITEM, [hotkey, self._netuid])
                for hotkey in hotkeys[start : start + QUERY_MULTI_BATCH]
            ]
            for storage_key, value in self._s.query_multi(storage_keys, block_hash=block_hash):
                try:
                    hotkey = canonical_hotkey(str(storage_key.params[0]))
                    result[hotkey] = decode_int(value, what="stake")
                except (ValueError, IndexError, AttributeError) as exc:
                    log.warning("skipping malformed stake entry: %s", exc)
        return result

    # -- commitments and weights -----------------------------------------------------------------

    def commitments(self, block_hash: str | None) -> dict[str, Commitment]:
        """Every well-formed commitment on the subnet, by hotkey."""
        out: dict[str, Commitment] = {}
        records = self._s.query_map(
            "Commitments",
            "CommitmentOf",
            [self._netuid],
            block_hash=block_hash,
            max_results=MAX_COMMITMENT_ENTRIES,
            page_size=1000,
        )
        for key, value in records:
            try:
                hotkey = decode_account(key)
            except ValueError:
                continue
            commitment = commitment_of(hotkey, unwrap(value))
            if commitment is not None:
                out[commitment.hotkey] = commitment
        return out

    def weights(self, block_hash: str | None) -> dict[int, dict[int, float]]:
        """Every validator's normalised weights, by validator uid (empty rows left out)."""
        out: dict[int, dict[int, float]] = {}
        records = self._s.query_map(
            "SubtensorModule",
            "Weights",
            [self._netuid],
            block_hash=block_hash,
            max_results=MAX_UID + 1,
            page_size=1000,
        )
        for key, value in records:
            try:
                uid = decode_int(key, hi=MAX_UID, what="uid")
                row = normalise_pairs(decode_weight_pairs(value))
            except ValueError as exc:
                log.warning("skipping malformed Weights entry on subnet %d: %s", self._netuid, exc)
                continue
            if row:
                out[uid] = row
        return out


def commitment_of(hotkey: str, value: object) -> Commitment | None:
    """A decoded `CommitmentOf` value as a `Commitment`, or None if it is malformed."""
    try:
        data, block = decode_registration(value)
        return Commitment(hotkey=hotkey, data=data, block=block)
    except (ValueError, ValidationError) as exc:
        log.debug("ignoring malformed commitment of %s: %s", hotkey, str(exc)[:200])
        return None


def read(fn: Callable[[], T], what: str) -> T:
    """`fn()`, with a decoding `ValueError` turned into a `ChainError` naming `what`."""
    try:
        return fn()
    except ValueError as exc:
        raise ChainError(f"malformed {what} from chain: {exc}") from exc
