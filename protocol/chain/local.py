"""The embedded local chain: a `Chain` backed by one SQLite file, for simulations and tests.

Rules it enforces, mirroring subtensor so that code tested here behaves the same on Bittensor:

- Caller proof: every write takes the hotkey's `Keypair`; the chain signs a domain-separated
  payload (chain id, netuid, action, hotkey, SHA-256 of the arguments) with it and verifies the
  signature against the hotkey's public key, so only a holder of the secret can write for a hotkey.
- Registration: only registered hotkeys may commit or set weights (`NotRegistered` otherwise).
- Commitments: one raw field of at most 128 bytes (`CommitmentTooLarge`). Rate limit as in the
  Commitments pallet: each commit costs max(100, len(data)) bytes of a per-hotkey budget of
  `commit_max_space` bytes (default 3100, subtensor's MaxSpace) per epoch, where
  epoch = (block + netuid + 1) // (tempo + 1); over budget raises `RateLimited`.
- Weights: the validator needs a validator permit; uids must be registered, unique, weights finite
  and non-negative, not all zero; they are normalised to sum 1 (zeros dropped). `version_key`
  must be >= the subnet's `weights_version_key`; with `weights_rate_limit` > 0 a validator must
  wait that many blocks between two `set_weights` (`RateLimited`).
- History: every change is kept with its block, so `snapshot(block)` returns exactly the state
  after the writes of blocks <= block, for any block at least 2 behind the head (see
  `protocol.chain.local_history` for why a snapshot can never change afterwards).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import sqlite3
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path

from pydantic import ValidationError
from substrateinterface import Keypair, KeypairType

from protocol.chain import local_history as history
from protocol.chain.base import Chain
from protocol.chain.errors import (
    BlockNotFinal,
    ChainError,
    CommitmentTooLarge,
    InvalidWeights,
    NotRegistered,
    PermissionDenied,
    RateLimited,
)
from protocol.chain.local_db import Clock, LocalChainDB, SubnetParams
from protocol.chain.models import (
    MAX_COMMITMENT_BYTES,
    MAX_UID,
    ChainSnapshot,
    Commitment,
    Metagraph,
    Neuron,
    canonical_hotkey,
    hotkey_from_public_key,
)
from protocol.chain.weights import validate_version_key, validate_weights

log = logging.getLogger(f"tessera.{__name__}")

SIGNING_DOMAIN = b"tessera-local-chain/v1"
MIN_COMMIT_COST = 100
"""Subtensor charges every commitment at least 100 bytes of rate-limit space."""


class LocalChain(Chain):
    """One subnet of a local chain file. Open many in many processes; they all agree."""

    def __init__(self, path: str | Path, netuid: int, *, clock: Clock = time.time) -> None:
        if isinstance(netuid, bool) or not isinstance(netuid, int) or not 0 <= netuid <= MAX_UID:
            raise ValueError(f"netuid must be an integer in [0, {MAX_UID}]")
        self._db = LocalChainDB(path, clock=clock)
        self._netuid = netuid
        try:
            with self._db.transaction(write=False) as conn:
                self._db.subnet(netuid, conn)
        except BaseException:
            self._db.close()
            raise

    @property
    def netuid(self) -> int:
        return self._netuid

    @property
    def url(self) -> str:
        return f"local://{self._db.path.resolve()}"

    @property
    def db(self) -> LocalChainDB:
        """The underlying file, for admin actions (register, stake) in tools and tests."""
        return self._db

    def params(self) -> SubnetParams:
        with self._db.transaction(write=False) as conn:
            return self._db.subnet(self._netuid, conn)

    def close(self) -> None:
        self._db.close()

    # -- time ------------------------------------------------------------------------------------

    def block(self) -> int:
        return self._db.block()

    def block_timestamp(self, block: int) -> datetime:
        _check_block_arg(block)
        head = self.block()  # first: it reads the clock again (`LocalChainDB.fast_forward`)
        clock = self._db.clock
        if block < clock.genesis_block:
            raise ChainError(f"block {block} predates genesis block {clock.genesis_block}")
        if block > head:
            raise ChainError(f"block {block} does not exist yet (head is {head})")
        return clock.time_of(block)

    # -- membership ------------------------------------------------------------------------------

    def metagraph(self) -> Metagraph:
        with self._db.transaction(write=False) as conn:
            block = self._db.block()
            rows = history.neuron_rows(conn, self._netuid, None)
        return _metagraph(self._netuid, block, rows)

    def uid_of(self, hotkey: str) -> int | None:
        key = canonical_hotkey(hotkey)
        with self._db.transaction(write=False) as conn:
            return self._db.uid_of(conn, self._netuid, key)

    # -- commitments -----------------------------------------------------------------------------

    def commit(self, keypair: Keypair, data: bytes) -> Commitment:
        blob = _as_bytes(data)
        if len(blob) > MAX_COMMITMENT_BYTES:
            raise CommitmentTooLarge(
                f"commitment is {len(blob)} bytes; the chain stores at most {MAX_COMMITMENT_BYTES}"
            )
        hotkey = self._authenticate(keypair, "commit", blob)
        with self._db.transaction(write=True) as conn:
            params = self._db.subnet(self._netuid, conn)
            self._db.require_uid(conn, self._netuid, hotkey)
            block = self._db.stamp(conn)
            epoch = params.epoch_of(block)
            row = conn.execute(
                "SELECT epoch, used_space FROM commitment_usage WHERE netuid = ? AND hotkey = ?",
                (self._netuid, hotkey),
            ).fetchone()
            used = int(row[1]) if row is not None and int(row[0]) == epoch else 0
            cost = max(MIN_COMMIT_COST, len(blob))
            if used + cost > params.commit_max_space:
                wait = params.first_block_of_epoch(epoch + 1) - block
                raise RateLimited(
                    f"hotkey {hotkey} used {used} of {params.commit_max_space} commitment bytes "
                    f"this epoch (a commit costs max({MIN_COMMIT_COST}, len) bytes); "
                    f"the budget resets in {wait} blocks",
                    retry_after_blocks=wait,
                )
            conn.execute(
                "INSERT INTO commitment_usage (netuid, hotkey, epoch, used_space) VALUES (?,?,?,?) "
                "ON CONFLICT (netuid, hotkey) DO UPDATE SET epoch = excluded.epoch, "
                "used_space = excluded.used_space",
                (self._netuid, hotkey, epoch, used + cost),
            )
            history.put_commitment(conn, self._netuid, hotkey, blob, block)
        return Commitment(hotkey=hotkey, data=blob, block=block)

    def read_commitment(self, hotkey: str) -> Commitment | None:
        key = canonical_hotkey(hotkey)
        with self._db.transaction(write=False) as conn:
            rows = history.commitment_rows(conn, self._netuid, None, hotkey=key)
        return _commitments(rows).get(key)

    def read_all_commitments(self) -> dict[str, Commitment]:
        with self._db.transaction(write=False) as conn:
            rows = history.commitment_rows(conn, self._netuid, None)
        return _commitments(rows)

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
        body = json.dumps(
            {"uids": list(uids), "weights": [float(w) for w in weights], "version": version_key},
            separators=(",", ":"),
        ).encode()
        hotkey = self._authenticate(keypair, "set_weights", body)
        with self._db.transaction(write=True) as conn:
            params = self._db.subnet(self._netuid, conn)
            vuid = self._db.require_uid(conn, self._netuid, hotkey)
            block = self._db.stamp(conn)
            self._check_may_set_weights(conn, params, hotkey, vuid, version_key)
            unknown = sorted(set(uids) - history.current_uids(conn, self._netuid))
            if unknown:
                raise InvalidWeights(
                    f"uids not registered on subnet {self._netuid}: {unknown[:10]}"
                )
            self._check_weights_rate(conn, params, vuid, block)
            history.put_weights(conn, self._netuid, vuid, normalised, block)
            history.update_neuron(conn, self._netuid, vuid, block, last_update=block)
            conn.execute(
                "INSERT INTO weight_sets (netuid, validator_uid, block, version_key) "
                "VALUES (?,?,?,?) ON CONFLICT (netuid, validator_uid) DO UPDATE SET "
                "block = excluded.block, version_key = excluded.version_key",
                (self._netuid, vuid, block, version_key),
            )

    def _check_may_set_weights(
        self,
        conn: sqlite3.Connection,
        params: SubnetParams,
        hotkey: str,
        vuid: int,
        version_key: int,
    ) -> None:
        if not history.current_neuron(conn, self._netuid, vuid)["validator_permit"]:
            raise PermissionDenied(
                f"hotkey {hotkey} (uid {vuid}) has no validator permit on subnet "
                f"{self._netuid}; register it with --validator"
            )
        if version_key < params.weights_version_key:
            raise ChainError(
                f"version_key {version_key} is below the subnet's weights version key "
                f"{params.weights_version_key}; upgrade the validator"
            )

    def _check_weights_rate(
        self, conn: sqlite3.Connection, params: SubnetParams, vuid: int, block: int
    ) -> None:
        last = conn.execute(
            "SELECT block FROM weight_sets WHERE netuid = ? AND validator_uid = ?",
            (self._netuid, vuid),
        ).fetchone()
        limit = params.weights_rate_limit
        if limit > 0 and last is not None and block - int(last[0]) < limit:
            wait = int(last[0]) + limit - block
            raise RateLimited(
                f"validator uid {vuid} set weights at block {last[0]}; the subnet allows one "
                f"set_weights per {limit} blocks (retry in {wait} blocks)",
                retry_after_blocks=wait,
            )

    def read_weights(self, validator: int | str) -> dict[int, float]:
        with self._db.transaction(write=False) as conn:
            if isinstance(validator, str):
                key = canonical_hotkey(validator)
                vuid = self._db.uid_of(conn, self._netuid, key)
                if vuid is None:
                    raise NotRegistered(key, self._netuid, "it has no uid and so no weights")
            elif isinstance(validator, int) and not isinstance(validator, bool):
                if not 0 <= validator <= MAX_UID:
                    raise ValueError(f"uid must be in [0, {MAX_UID}]")
                vuid = validator
            else:
                raise TypeError("validator must be a uid (int) or a hotkey (str)")
            rows = history.weight_rows(conn, self._netuid, None, validator=vuid)
        return _weights(rows).get(vuid, {})

    def weights_all(self) -> dict[int, dict[int, float]]:
        with self._db.transaction(write=False) as conn:
            rows = history.weight_rows(conn, self._netuid, None)
        return _weights(rows)

    # -- one block, pinned -----------------------------------------------------------------------

    def snapshot(self, block: int) -> ChainSnapshot:
        """The subnet after every write of blocks <= `block` (`Chain.snapshot`).

        Final here means at least `FINALITY_DEPTH` (2) blocks behind the head. The read holds the
        file's write lock and seals `block` in the same transaction, so no write, however late or
        whatever its clock says, can land in a block once it has been read
        (`protocol.chain.local_history` has the argument).
        """
        _check_block_arg(block)
        with self._db.transaction(write=True) as conn:
            self._check_final(conn, block)
            history.seal(conn, block)
            neurons = history.neuron_rows(conn, self._netuid, block)
            commitments = history.commitment_rows(conn, self._netuid, block)
            weights = history.weight_rows(conn, self._netuid, block)
        try:
            return ChainSnapshot(
                block=block,
                block_hash=self._block_hash(block),
                metagraph=_metagraph(self._netuid, block, neurons),
                commitments=_commitments(commitments),
                weights=_weights(weights),
            )
        except ValidationError as exc:
            raise ChainError(f"local chain {self.url} holds an inconsistent block: {exc}") from exc

    def _check_final(self, conn: sqlite3.Connection, block: int) -> None:
        head = self._db.block()
        latest = head - history.FINALITY_DEPTH
        if block > latest:
            raise BlockNotFinal(
                f"block {block} is not final yet on the local chain (head {head}; a block is "
                f"final {history.FINALITY_DEPTH} blocks later, so the newest final is {latest})",
                block=block,
                latest_final=latest,
            )
        created = self._db.subnet(self._netuid, conn).created_block
        if block < max(created, self._db.clock.genesis_block):
            raise ChainError(f"subnet {self._netuid} did not exist yet at block {block}")

    def _block_hash(self, block: int) -> str:
        """A deterministic stand-in for a block hash: the same for every handle on this chain."""
        seed = f"{self._db.clock.chain_id}/{block}".encode()
        return "0x" + hashlib.blake2b(seed, digest_size=32).hexdigest()

    # -- caller proof ----------------------------------------------------------------------------

    def _authenticate(self, keypair: Keypair, action: str, body: bytes) -> str:
        """Prove the caller holds the hotkey's secret; return the hotkey (SS58, format 42)."""
        if not isinstance(keypair, Keypair):
            raise TypeError("pass the hotkey's substrateinterface.Keypair")
        if keypair.crypto_type not in (KeypairType.SR25519, KeypairType.ED25519):
            raise PermissionDenied("hotkeys must be sr25519 or ed25519 keypairs")
        try:
            hotkey = hotkey_from_public_key(bytes(keypair.public_key))
        except (TypeError, ValueError) as exc:
            raise PermissionDenied("the keypair has no valid public key") from exc
        payload = b"\x00".join(
            [
                SIGNING_DOMAIN,
                self._db.clock.chain_id.encode(),
                str(self._netuid).encode(),
                action.encode(),
                hotkey.encode(),
                hashlib.sha256(body).digest(),
            ]
        )
        try:
            signature = keypair.sign(payload)
        except Exception as exc:  # no private key, or a broken one; never echo key material
            raise PermissionDenied(
                f"cannot sign for hotkey {hotkey}: the keypair holds no usable private key"
            ) from exc
        verifier = Keypair(
            public_key=bytes(keypair.public_key), crypto_type=keypair.crypto_type, ss58_format=42
        )
        if not verifier.verify(payload, signature):
            raise PermissionDenied(f"signature check failed for hotkey {hotkey}")
        return hotkey


def _as_bytes(data: bytes) -> bytes:
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError("commitment data must be bytes")
    return bytes(data)


def _check_block_arg(block: int) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 0:
        raise ValueError("block must be a non-negative integer")


def _metagraph(netuid: int, block: int, rows: Sequence[history.NeuronRow]) -> Metagraph:
    """The neurons of `rows`, malformed ones skipped."""
    neurons: list[Neuron] = []
    for uid, hotkey, stake, permit, registered, last_update in rows:
        try:
            neurons.append(
                Neuron.model_validate(
                    {
                        "uid": uid,
                        "hotkey": hotkey,
                        "stake": stake,
                        "validator_permit": bool(permit),
                        "registered_block": registered,
                        "last_update": last_update,
                    }
                )
            )
        except ValidationError:
            log.warning("skipping malformed neuron row uid=%r on subnet %d", uid, netuid)
    return Metagraph(netuid=netuid, block=block, neurons=tuple(neurons))


def _commitments(rows: Sequence[tuple[object, ...]]) -> dict[str, Commitment]:
    """Well-formed commitments of `rows` by hotkey (malformed ones skipped)."""
    result: dict[str, Commitment] = {}
    for hotkey, data, block in rows:
        try:
            commitment = Commitment.model_validate({"hotkey": hotkey, "data": data, "block": block})
        except ValidationError:
            log.warning("skipping malformed commitment row for %r", str(hotkey)[:64])
            continue
        result[commitment.hotkey] = commitment
    return result


def _weights(rows: Sequence[tuple[object, ...]]) -> dict[int, dict[int, float]]:
    """(validator, uid, weight) rows as normalised rows by validator (empty rows left out)."""
    grouped: dict[int, list[tuple[object, object]]] = {}
    for vuid, uid, weight in rows:
        if isinstance(vuid, int) and 0 <= vuid <= MAX_UID:
            grouped.setdefault(vuid, []).append((uid, weight))
    result = {vuid: _renormalise(pairs) for vuid, pairs in grouped.items()}
    return {vuid: row for vuid, row in result.items() if row}


def _renormalise(pairs: Sequence[tuple[object, object]]) -> dict[int, float]:
    clean: dict[int, float] = {}
    for uid, weight in pairs:
        if (
            isinstance(uid, int)
            and 0 <= uid <= MAX_UID
            and isinstance(weight, int | float)
            and math.isfinite(weight)
            and weight > 0
        ):
            clean[uid] = float(weight)
    total = math.fsum(clean.values())
    if not total > 0:
        return {}
    return {uid: w / total for uid, w in sorted(clean.items())}
