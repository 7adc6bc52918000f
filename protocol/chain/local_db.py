"""The SQLite file behind the embedded local chain: schema, clock, transactions and admin actions.

One file holds one chain (any number of subnets). Many processes on one machine may open it at
once: the database runs in WAL mode with a busy timeout, and every write happens inside
`BEGIN IMMEDIATE`, so writers queue instead of failing and readers see consistent snapshots.

Time is the wall clock: `block = genesis_block + floor((now - genesis_time) / block_time)`, with
the three numbers stored in the `meta` table so that every process derives the same block.

Admin actions (create a subnet, register a hotkey, stake) stand in for what sudo, registration
and staking extrinsics do on a real chain; they need no signature because whoever can write the
file owns this chain anyway.
"""

from __future__ import annotations

import math
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from protocol.chain.errors import ChainError, ChainUnavailable, NotRegistered
from protocol.chain.models import MAX_BLOCK, MAX_STAKE_TAO, MAX_UID, canonical_hotkey

SCHEMA_VERSION = 1
BUSY_TIMEOUT_S = 30.0

Clock = Callable[[], float]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS subnets (
    netuid INTEGER PRIMARY KEY CHECK (netuid BETWEEN 0 AND 65535),
    tempo INTEGER NOT NULL CHECK (tempo >= 1),
    max_uids INTEGER NOT NULL CHECK (max_uids BETWEEN 1 AND 65536),
    commit_max_space INTEGER NOT NULL CHECK (commit_max_space >= 0),
    weights_rate_limit INTEGER NOT NULL CHECK (weights_rate_limit >= 0),
    weights_version_key INTEGER NOT NULL DEFAULT 0 CHECK (weights_version_key >= 0),
    created_block INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS neurons (
    netuid INTEGER NOT NULL REFERENCES subnets (netuid),
    uid INTEGER NOT NULL CHECK (uid BETWEEN 0 AND 65535),
    hotkey TEXT NOT NULL,
    coldkey TEXT,
    stake REAL NOT NULL DEFAULT 0 CHECK (stake >= 0),
    validator_permit INTEGER NOT NULL DEFAULT 0,
    registered_block INTEGER NOT NULL,
    PRIMARY KEY (netuid, uid),
    UNIQUE (netuid, hotkey)
);
CREATE TABLE IF NOT EXISTS commitments (
    netuid INTEGER NOT NULL,
    hotkey TEXT NOT NULL,
    data BLOB NOT NULL,
    block INTEGER NOT NULL,
    PRIMARY KEY (netuid, hotkey)
);
CREATE TABLE IF NOT EXISTS commitment_usage (
    netuid INTEGER NOT NULL,
    hotkey TEXT NOT NULL,
    epoch INTEGER NOT NULL,
    used_space INTEGER NOT NULL,
    PRIMARY KEY (netuid, hotkey)
);
CREATE TABLE IF NOT EXISTS weights (
    netuid INTEGER NOT NULL,
    validator_uid INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    weight REAL NOT NULL,
    PRIMARY KEY (netuid, validator_uid, uid)
);
CREATE TABLE IF NOT EXISTS weight_sets (
    netuid INTEGER NOT NULL,
    validator_uid INTEGER NOT NULL,
    block INTEGER NOT NULL,
    version_key INTEGER NOT NULL,
    PRIMARY KEY (netuid, validator_uid)
);
"""


class ChainClock(BaseModel):
    """The chain-wide constants that turn wall-clock time into block numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    chain_id: str = Field(min_length=16, max_length=64, pattern=r"^[0-9a-f]+$")
    genesis_time: float = Field(gt=0)
    genesis_block: int = Field(ge=0, le=MAX_BLOCK)
    block_time: float = Field(gt=0, le=3600)

    def block_at(self, now: float) -> int:
        if not math.isfinite(now):
            raise ChainError("the clock returned a non-finite time")
        elapsed = max(0.0, now - self.genesis_time)
        return min(MAX_BLOCK, self.genesis_block + math.floor(elapsed / self.block_time))

    def time_of(self, block: int) -> datetime:
        seconds = self.genesis_time + (block - self.genesis_block) * self.block_time
        return datetime.fromtimestamp(seconds, tz=UTC)


class SubnetParams(BaseModel):
    """Per-subnet rules of the local chain (mirroring the matching subtensor hyperparameters)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    netuid: int = Field(ge=0, le=MAX_UID)
    tempo: int = Field(360, ge=1, le=65_535, description="blocks per epoch (subtensor Tempo)")
    max_uids: int = Field(256, ge=1, le=MAX_UID + 1)
    commit_max_space: int = Field(
        3100, ge=0, description="commitment bytes per hotkey per epoch (Commitments MaxSpace)"
    )
    weights_rate_limit: int = Field(
        0, ge=0, description="blocks between two set_weights of one validator (0: no limit)"
    )
    weights_version_key: int = Field(0, ge=0, description="lowest version_key accepted")
    created_block: int = Field(0, ge=0, le=MAX_BLOCK)

    def epoch_of(self, block: int) -> int:
        """Subtensor's epoch index: (block + netuid + 1) // (tempo + 1)."""
        return (block + self.netuid + 1) // (self.tempo + 1)

    def first_block_of_epoch(self, epoch: int) -> int:
        return max(0, epoch * (self.tempo + 1) - self.netuid - 1)


def _register_hint(path: Path, hotkey: str, netuid: int) -> str:
    return (
        f"register it with `tessera chain register --db {path} --netuid {netuid} "
        f"--hotkey {hotkey}` (add --validator to let it set weights)"
    )


class LocalChainDB:
    """An open connection to a local chain file, safe to share between threads of one process."""

    def __init__(self, path: str | Path, *, clock: Clock = time.time) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise ChainError(
                f"no local chain at {self.path}; create one with "
                f"`tessera chain create --db {self.path} --netuid N --block-time S`"
            )
        self._clock = clock
        self._lock = threading.RLock()
        self._conn = _connect(self.path)
        try:
            self.clock = self._read_clock()
        except BaseException:
            self._conn.close()
            raise

    # -- plumbing --------------------------------------------------------------------------------

    @contextmanager
    def transaction(self, *, write: bool) -> Iterator[sqlite3.Connection]:
        """A consistent snapshot (`write=False`) or a serialised write (`BEGIN IMMEDIATE`)."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            except sqlite3.OperationalError as exc:
                raise ChainUnavailable(f"local chain {self.path} is busy: {exc}") from exc
            try:
                yield self._conn
                self._conn.execute("COMMIT")
            except BaseException as exc:
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                if isinstance(exc, sqlite3.OperationalError):
                    raise ChainUnavailable(f"local chain {self.path} failed: {exc}") from exc
                if isinstance(exc, sqlite3.DatabaseError):
                    raise ChainError(f"local chain {self.path} is damaged: {exc}") from exc
                raise

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def now(self) -> float:
        return float(self._clock())

    def block(self) -> int:
        return self.clock.block_at(self.now())

    def _read_clock(self) -> ChainClock:
        try:
            rows = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            raise ChainError(f"{self.path} is not a local chain database: {exc}") from exc
        if rows.get("schema_version") != str(SCHEMA_VERSION):
            raise ChainError(
                f"{self.path} has schema version {rows.get('schema_version')!r}, "
                f"this code reads {SCHEMA_VERSION}"
            )
        try:
            return ChainClock(
                chain_id=rows["chain_id"],
                genesis_time=float(rows["genesis_time"]),
                genesis_block=int(rows["genesis_block"]),
                block_time=float(rows["block_time"]),
            )
        except (KeyError, ValueError) as exc:
            raise ChainError(f"{self.path} has a corrupt meta table: {exc}") from exc

    # -- subnets ---------------------------------------------------------------------------------

    def subnet(self, netuid: int, conn: sqlite3.Connection | None = None) -> SubnetParams:
        c = conn or self._conn
        row = c.execute(
            "SELECT netuid, tempo, max_uids, commit_max_space, weights_rate_limit, "
            "weights_version_key, created_block FROM subnets WHERE netuid = ?",
            (netuid,),
        ).fetchone()
        if row is None:
            raise ChainError(
                f"subnet {netuid} does not exist in {self.path}; create it with "
                f"`tessera chain create --db {self.path} --netuid {netuid}`"
            )
        keys = SubnetParams.model_fields
        return SubnetParams(**dict(zip(keys, row, strict=True)))

    def subnets(self) -> list[SubnetParams]:
        with self.transaction(write=False) as conn:
            netuids = [r[0] for r in conn.execute("SELECT netuid FROM subnets ORDER BY netuid")]
            return [self.subnet(n, conn) for n in netuids]

    def add_subnet(self, params: SubnetParams, *, exist_ok: bool = False) -> SubnetParams:
        with self.transaction(write=True) as conn:
            exists = conn.execute(
                "SELECT 1 FROM subnets WHERE netuid = ?", (params.netuid,)
            ).fetchone()
            if exists:
                if exist_ok:
                    return self.subnet(params.netuid, conn)
                raise ChainError(f"subnet {params.netuid} already exists in {self.path}")
            created = params.model_copy(update={"created_block": self.block()})
            conn.execute(
                "INSERT INTO subnets (netuid, tempo, max_uids, commit_max_space, "
                "weights_rate_limit, weights_version_key, created_block) VALUES (?,?,?,?,?,?,?)",
                (
                    created.netuid,
                    created.tempo,
                    created.max_uids,
                    created.commit_max_space,
                    created.weights_rate_limit,
                    created.weights_version_key,
                    created.created_block,
                ),
            )
            return created

    # -- neurons ---------------------------------------------------------------------------------

    def uid_of(self, conn: sqlite3.Connection, netuid: int, hotkey: str) -> int | None:
        row = conn.execute(
            "SELECT uid FROM neurons WHERE netuid = ? AND hotkey = ?", (netuid, hotkey)
        ).fetchone()
        return None if row is None else int(row[0])

    def require_uid(self, conn: sqlite3.Connection, netuid: int, hotkey: str) -> int:
        uid = self.uid_of(conn, netuid, hotkey)
        if uid is None:
            raise NotRegistered(hotkey, netuid, _register_hint(self.path, hotkey, netuid))
        return uid

    def register(
        self,
        netuid: int,
        hotkey: str,
        *,
        coldkey: str | None = None,
        validator: bool = False,
        stake: float = 0.0,
    ) -> int:
        """Give `hotkey` the lowest free uid on the subnet; returns it."""
        key = canonical_hotkey(hotkey)
        cold = canonical_hotkey(coldkey) if coldkey is not None else None
        _check_stake(stake)
        with self.transaction(write=True) as conn:
            params = self.subnet(netuid, conn)
            if self.uid_of(conn, netuid, key) is not None:
                raise ChainError(f"hotkey {key} is already registered on subnet {netuid}")
            taken = {
                r[0] for r in conn.execute("SELECT uid FROM neurons WHERE netuid = ?", (netuid,))
            }
            uid = next((u for u in range(params.max_uids) if u not in taken), None)
            if uid is None:
                raise ChainError(f"subnet {netuid} is full ({params.max_uids} uids)")
            conn.execute(
                "INSERT INTO neurons (netuid, uid, hotkey, coldkey, stake, validator_permit, "
                "registered_block) VALUES (?,?,?,?,?,?,?)",
                (netuid, uid, key, cold, float(stake), int(validator), self.block()),
            )
            return uid

    def add_stake(self, netuid: int, hotkey: str, amount: float) -> float:
        """Add `amount` TAO (negative to unstake) to the hotkey's stake; returns the new stake."""
        key = canonical_hotkey(hotkey)
        if not math.isfinite(amount):
            raise ValueError("stake amount must be finite")
        with self.transaction(write=True) as conn:
            self.subnet(netuid, conn)
            self.require_uid(conn, netuid, key)
            (current,) = conn.execute(
                "SELECT stake FROM neurons WHERE netuid = ? AND hotkey = ?", (netuid, key)
            ).fetchone()
            new = float(current) + float(amount)
            if new < 0:
                raise ChainError(f"cannot unstake {-amount} TAO: hotkey {key} has {current} TAO")
            _check_stake(new)
            conn.execute(
                "UPDATE neurons SET stake = ? WHERE netuid = ? AND hotkey = ?", (new, netuid, key)
            )
            return new

    def set_validator_permit(self, netuid: int, hotkey: str, permit: bool) -> None:
        key = canonical_hotkey(hotkey)
        with self.transaction(write=True) as conn:
            self.subnet(netuid, conn)
            self.require_uid(conn, netuid, key)
            conn.execute(
                "UPDATE neurons SET validator_permit = ? WHERE netuid = ? AND hotkey = ?",
                (int(permit), netuid, key),
            )


def _check_stake(stake: float) -> None:
    if not math.isfinite(stake) or not 0.0 <= stake <= MAX_STAKE_TAO:
        raise ValueError(f"stake must be finite and in [0, {MAX_STAKE_TAO:g}] TAO")


def _connect(path: Path) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(
            str(path), timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False
        )
    except sqlite3.OperationalError as exc:
        raise ChainUnavailable(f"cannot open local chain {path}: {exc}") from exc
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if str(mode).lower() != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute("PRAGMA foreign_keys = ON")
    except sqlite3.OperationalError as exc:
        conn.close()
        raise ChainUnavailable(f"cannot open local chain {path}: {exc}") from exc
    except sqlite3.DatabaseError as exc:
        conn.close()
        raise ChainError(f"{path} is not a local chain database: {exc}") from exc
    return conn


def create_local_chain(
    path: str | Path,
    netuid: int,
    *,
    block_time: float = 12.0,
    tempo: int = 360,
    max_uids: int = 256,
    commit_max_space: int = 3100,
    weights_rate_limit: int = 0,
    weights_version_key: int = 0,
    exist_ok: bool = False,
    clock: Clock = time.time,
) -> SubnetParams:
    """Create the chain file (if needed) and subnet `netuid` in it.

    The block time is fixed when the file is created; asking for another one later is an error.
    With `exist_ok`, an existing subnet is returned unchanged.
    """
    file = Path(path)
    if not math.isfinite(block_time) or not 0 < block_time <= 3600:
        raise ValueError("block_time must be in (0, 3600] seconds")
    params = SubnetParams(
        netuid=netuid,
        tempo=tempo,
        max_uids=max_uids,
        commit_max_space=commit_max_space,
        weights_rate_limit=weights_rate_limit,
        weights_version_key=weights_version_key,
    )
    file.parent.mkdir(parents=True, exist_ok=True)
    conn = _connect(file)
    try:
        conn.execute("BEGIN IMMEDIATE")
        try:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)
            rows = dict(conn.execute("SELECT key, value FROM meta").fetchall())
            if not rows:
                now = float(clock())
                conn.executemany(
                    "INSERT INTO meta (key, value) VALUES (?, ?)",
                    [
                        ("schema_version", str(SCHEMA_VERSION)),
                        ("chain_id", secrets.token_hex(16)),
                        ("genesis_time", repr(now)),
                        ("genesis_block", "0"),
                        ("block_time", repr(float(block_time))),
                    ],
                )
            elif not math.isclose(float(rows.get("block_time", "nan")), block_time):
                raise ChainError(
                    f"{file} already exists with block time {rows.get('block_time')} s; "
                    "the block time is fixed at creation"
                )
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")
    finally:
        conn.close()
    db = LocalChainDB(file, clock=clock)
    try:
        return db.add_subnet(params, exist_ok=exist_ok)
    finally:
        db.close()
