"""The SQLite file behind the embedded local chain: clock, transactions and admin actions.

One file holds one chain (any number of subnets). Many processes on one machine may open it at
once: the database runs in WAL mode with a busy timeout, and every write happens inside
`BEGIN IMMEDIATE`, so writers queue instead of failing and readers see consistent snapshots.
The schema, the history of every change and the rule that pins a block are in
`protocol.chain.local_history`; a file of another schema version is refused, not converted.

Time is the wall clock: `block = genesis_block + floor((now - genesis_time) / block_time)`, with
the three numbers stored in the `meta` table so that every process derives the same block.
`LocalChainDB.fast_forward` skips the head ahead at once by moving the genesis time back (what a
simulation does once every member is up instead of idling until window 0); every process reads
the genesis time again at each block, so all of them see the skip together and blocks only ever
go forward. A local block carries no content of its own, so nothing but time is skipped; the
timestamps of the blocks before the skip move back with it.

Admin actions (create a subnet, register or replace a hotkey, stake, validator permit) stand in
for what sudo, registration and staking extrinsics do on a real chain; they need no signature
because whoever can write the file owns this chain anyway. `LocalChainDB.set_outage` makes the
chain answer nothing for a while, as a chain endpoint that goes down does (for rehearsing faults:
`tessera sim --faults chain-stall`).
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

from protocol.chain import local_history as history
from protocol.chain.errors import ChainError, ChainUnavailable, NotRegistered
from protocol.chain.local_history import SCHEMA, SCHEMA_VERSION
from protocol.chain.models import MAX_BLOCK, MAX_STAKE_TAO, MAX_UID, canonical_hotkey

BUSY_TIMEOUT_S = 30.0
OUTAGE_KEY = "outage_until"
"""Meta key: until when (Unix time) every block and transaction fails with `ChainUnavailable`."""
GENESIS_KEY = "genesis_time"
"""Meta key: the Unix time of the genesis block (moved back by `LocalChainDB.fast_forward`)."""
FAST_FORWARD_MARGIN = 1e-3
"""Of a block time: how far past a skipped-to block's start the head lands (no rounding short)."""

Clock = Callable[[], float]


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


def _meta_float(rows: dict[str, str], key: str, default: float) -> float:
    if key not in rows:
        return default
    try:
        return float(rows[key])
    except ValueError as exc:
        raise ChainError(f"the local chain's meta value {key!r} is corrupt") from exc


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
            self._check_up()
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
        with self._lock:
            self._check_up()
        return self.clock.block_at(self.now())

    def fast_forward(self, block: int) -> int:
        """Skip the head ahead to `block` now, as if the blocks before it had passed (the module
        docstring); a `block` at or behind the head changes nothing. Returns the head."""
        if not 0 <= block <= MAX_BLOCK:
            raise ValueError(f"block must be in [0, {MAX_BLOCK}]")
        with self.transaction(write=True) as conn:
            head = self.block()
            if block <= head:
                return head
            c = self.clock
            skipped = (block - c.genesis_block + FAST_FORWARD_MARGIN) * c.block_time
            genesis = min(c.genesis_time, self.now() - skipped)
            conn.execute("UPDATE meta SET value = ? WHERE key = ?", (repr(genesis), GENESIS_KEY))
            self.clock = c.model_copy(update={"genesis_time": genesis})
        return self.block()

    def set_outage(self, seconds: float) -> None:
        """Make every process's chain calls (`block` and every read or write) fail with
        `ChainUnavailable` for `seconds` from now, as an unreachable chain endpoint does; blocks
        go on meanwhile. ``0`` ends an outage."""
        if not math.isfinite(seconds) or not 0 <= seconds <= 3600:
            raise ValueError("an outage lasts between 0 and 3600 seconds")
        until = repr(self.now() + seconds)
        with self._lock:
            self._conn.execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (OUTAGE_KEY, until)
            )

    def owner_block(self) -> int:
        """The head as the chain's owner reads it, through an outage (the simulation's fault
        injector, which makes the outages)."""
        with self._lock:
            self._refresh_clock(self._live_meta())
        return self.clock.block_at(self.now())

    def _check_up(self) -> None:
        """`ChainUnavailable` during an outage; otherwise the clock's genesis read again (a
        `fast_forward` by any process)."""
        rows = self._live_meta()
        until = _meta_float(rows, OUTAGE_KEY, -math.inf)
        if until > -math.inf and self.now() < until:  # the clock read only for an outage
            raise ChainUnavailable(f"local chain {self.path} is down (an outage until {until:.0f})")
        self._refresh_clock(rows)

    def _live_meta(self) -> dict[str, str]:
        """The meta values that change while the chain runs: an outage, the genesis time."""
        try:
            return dict(
                self._conn.execute(
                    "SELECT key, value FROM meta WHERE key IN (?, ?)", (OUTAGE_KEY, GENESIS_KEY)
                ).fetchall()
            )
        except sqlite3.OperationalError as exc:
            raise ChainUnavailable(f"local chain {self.path} is busy: {exc}") from exc

    def _refresh_clock(self, rows: dict[str, str]) -> None:
        genesis = _meta_float(rows, GENESIS_KEY, self.clock.genesis_time)
        if genesis != self.clock.genesis_time:
            if not math.isfinite(genesis) or genesis > self.clock.genesis_time:
                raise ChainError(f"the local chain's genesis time moved to {genesis!r}")
            self.clock = self.clock.model_copy(update={"genesis_time": genesis})

    def _read_clock(self) -> ChainClock:
        try:
            rows = dict(self._conn.execute("SELECT key, value FROM meta").fetchall())
        except sqlite3.DatabaseError as exc:
            raise ChainError(f"{self.path} is not a local chain database: {exc}") from exc
        _check_schema_version(self.path, rows.get("schema_version"))
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

    def stamp(self, conn: sqlite3.Connection) -> int:
        """The block of a write in progress (call inside its write transaction; see
        `local_history`)."""
        return history.stamp(conn, self.block())

    def uid_of(self, conn: sqlite3.Connection, netuid: int, hotkey: str) -> int | None:
        return history.current_uid(conn, netuid, hotkey)

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
        replace_uid: int | None = None,
    ) -> int:
        """Give `hotkey` the lowest free uid on the subnet, or `replace_uid`; returns the uid.

        Replacing a uid works as subtensor's `replace_neuron`: the old hotkey loses the uid, the
        weights it set and the weights set for it end, and the new neuron starts with
        `registered_block` = this block and `last_update` = 0.
        """
        key = canonical_hotkey(hotkey)
        cold = canonical_hotkey(coldkey) if coldkey is not None else None
        _check_stake(stake)
        with self.transaction(write=True) as conn:
            params = self.subnet(netuid, conn)
            block = self.stamp(conn)
            if self.uid_of(conn, netuid, key) is not None:
                raise ChainError(f"hotkey {key} is already registered on subnet {netuid}")
            uid = self._uid_for(conn, params, replace_uid, block)
            fields = {
                "uid": uid,
                "hotkey": key,
                "coldkey": cold,
                "stake": float(stake),
                "validator_permit": int(validator),
                "registered_block": block,
            }
            history.add_neuron(conn, netuid, block, fields)
            return uid

    def _uid_for(
        self, conn: sqlite3.Connection, params: SubnetParams, replace: int | None, block: int
    ) -> int:
        """The uid a registration gets: `replace` (its neuron retired), else the lowest free."""
        taken = history.current_uids(conn, params.netuid)
        if replace is not None:
            if replace not in taken:
                raise ChainError(f"uid {replace} is not registered on subnet {params.netuid}")
            history.retire_neuron(conn, params.netuid, replace, block)
            return replace
        uid = next((u for u in range(params.max_uids) if u not in taken), None)
        if uid is None:
            raise ChainError(
                f"subnet {params.netuid} is full ({params.max_uids} uids); "
                "replace a uid (--replace-uid) to register"
            )
        return uid

    def add_stake(self, netuid: int, hotkey: str, amount: float) -> float:
        """Add `amount` TAO (negative to unstake) to the hotkey's stake; returns the new stake."""
        key = canonical_hotkey(hotkey)
        if not math.isfinite(amount):
            raise ValueError("stake amount must be finite")
        with self.transaction(write=True) as conn:
            self.subnet(netuid, conn)
            uid = self.require_uid(conn, netuid, key)
            block = self.stamp(conn)
            current = float(history.current_neuron(conn, netuid, uid)["stake"])
            new = current + float(amount)
            if new < 0:
                raise ChainError(f"cannot unstake {-amount} TAO: hotkey {key} has {current} TAO")
            _check_stake(new)
            history.update_neuron(conn, netuid, uid, block, stake=new)
            return new

    def set_validator_permit(self, netuid: int, hotkey: str, permit: bool) -> None:
        key = canonical_hotkey(hotkey)
        with self.transaction(write=True) as conn:
            self.subnet(netuid, conn)
            uid = self.require_uid(conn, netuid, key)
            block = self.stamp(conn)
            history.update_neuron(conn, netuid, uid, block, validator_permit=int(permit))


def _check_schema_version(path: Path, found: str | None) -> None:
    if found == str(SCHEMA_VERSION):
        return
    raise ChainError(
        f"{path} is a local chain of schema version {found!r}; this code reads version "
        f"{SCHEMA_VERSION} (which keeps the history that block snapshots need) and does not "
        f"convert old files: create a new one with `tessera chain create --db NEW.db ...` "
        "and register the hotkeys again"
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


def _refuse_other_schema(conn: sqlite3.Connection, path: Path) -> None:
    """Stop before touching a file written by another schema version."""
    has_meta = conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'"
    ).fetchone()
    if has_meta:
        row = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        if row is not None:
            _check_schema_version(path, row[0])


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
            _refuse_other_schema(conn, file)
            for statement in SCHEMA.split(";"):
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
