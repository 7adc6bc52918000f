"""The history of the embedded local chain: schema, versioned rows, and how a block gets pinned.

Neurons, commitments and weights are kept as *versions*: a row holds `valid_from` (the block of
the write that made it) and `valid_to` (the block of the write that replaced it; NULL while it is
current). The state at block B is every row with `valid_from <= B < valid_to` (or `valid_to`
NULL); the head is every row with `valid_to` NULL. Two writes in one block leave an empty version
`[B, B)` behind, so block B shows the last write of B.

Why a snapshot of block B can never change (the rule `LocalChain.snapshot` relies on):

1. Every write runs in one `BEGIN IMMEDIATE` transaction (the file's write lock) and takes its
   block inside it, from `stamp`, which refuses a block at or below the chain's *seal* (meta key
   `sealed_block`) with `ChainUnavailable` (the caller retries; the clock moves on).
2. `snapshot(B)` takes the same write lock and, in that one transaction, raises the seal to B and
   reads the versions visible at B.

The lock orders every write before or after every snapshot. A write ordered before the first
snapshot of B is in it; one ordered after it gets a block above the seal, so it is not in B, nor
in any block a snapshot has read. This holds whatever the clocks of the processes say and however
long a write takes. On top of that, only blocks at least `FINALITY_DEPTH` behind the head are
served (`BlockNotFinal` otherwise): that is what keeps writers from ever meeting the seal while
the processes' clocks agree within a block, and it matches subtensor, whose newest blocks are not
final either.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Mapping
from typing import Any

from protocol.chain.errors import ChainError, ChainUnavailable

SCHEMA_VERSION = 2
FINALITY_DEPTH = 2
"""A block is final (can be snapshotted) once the head is at least this many blocks past it."""
SEALED_KEY = "sealed_block"
LAST_WRITE_KEY = "last_write_block"
MAX_ROWS = 1_000_000

SCHEMA = """
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
    last_update INTEGER NOT NULL DEFAULT 0,
    valid_from INTEGER NOT NULL,
    valid_to INTEGER CHECK (valid_to IS NULL OR valid_to >= valid_from)
);
CREATE UNIQUE INDEX IF NOT EXISTS neurons_current_uid
    ON neurons (netuid, uid) WHERE valid_to IS NULL;
CREATE UNIQUE INDEX IF NOT EXISTS neurons_current_hotkey
    ON neurons (netuid, hotkey) WHERE valid_to IS NULL;
CREATE INDEX IF NOT EXISTS neurons_history ON neurons (netuid, valid_from);
CREATE TABLE IF NOT EXISTS commitments (
    netuid INTEGER NOT NULL,
    hotkey TEXT NOT NULL,
    data BLOB NOT NULL,
    valid_from INTEGER NOT NULL,
    valid_to INTEGER CHECK (valid_to IS NULL OR valid_to >= valid_from)
);
CREATE UNIQUE INDEX IF NOT EXISTS commitments_current
    ON commitments (netuid, hotkey) WHERE valid_to IS NULL;
CREATE INDEX IF NOT EXISTS commitments_history ON commitments (netuid, valid_from);
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
    valid_from INTEGER NOT NULL,
    valid_to INTEGER CHECK (valid_to IS NULL OR valid_to >= valid_from)
);
CREATE UNIQUE INDEX IF NOT EXISTS weights_current
    ON weights (netuid, validator_uid, uid) WHERE valid_to IS NULL;
CREATE INDEX IF NOT EXISTS weights_history ON weights (netuid, valid_from);
CREATE TABLE IF NOT EXISTS weight_sets (
    netuid INTEGER NOT NULL,
    validator_uid INTEGER NOT NULL,
    block INTEGER NOT NULL,
    version_key INTEGER NOT NULL,
    PRIMARY KEY (netuid, validator_uid)
);
"""

NeuronRow = tuple[object, ...]
"""(uid, hotkey, stake, validator_permit, registered_block, last_update), unvalidated."""


def visible(block: int | None) -> tuple[str, tuple[int, ...]]:
    """The WHERE clause (and its parameters) selecting the versions current at `block` (None:
    the head)."""
    if block is None:
        return "valid_to IS NULL", ()
    return "valid_from <= ? AND (valid_to IS NULL OR valid_to > ?)", (block, block)


# -- pinning -------------------------------------------------------------------------------------


def _meta_int(conn: sqlite3.Connection, key: str, default: int) -> int:
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
    try:
        return default if row is None else int(row[0])
    except ValueError as exc:
        raise ChainError(f"the local chain's meta value {key!r} is corrupt: {row[0]!r}") from exc


def _set_meta_int(conn: sqlite3.Connection, key: str, value: int) -> None:
    conn.execute(
        "INSERT INTO meta (key, value) VALUES (?, ?) "
        "ON CONFLICT (key) DO UPDATE SET value = excluded.value",
        (key, str(value)),
    )


def stamp(conn: sqlite3.Connection, clock_block: int) -> int:
    """The block of a write happening now; call it inside the write's transaction.

    Never earlier than the chain's last write (a clock that stepped back cannot reorder history),
    and refused when a snapshot has already sealed that block.
    """
    block = max(clock_block, _meta_int(conn, LAST_WRITE_KEY, 0))
    sealed = _meta_int(conn, SEALED_KEY, -1)
    if block <= sealed:
        raise ChainUnavailable(
            f"this process's clock puts the write in block {block}, but blocks up to {sealed} "
            "are already final and snapshotted; retry (is this machine's clock behind?)"
        )
    _set_meta_int(conn, LAST_WRITE_KEY, block)
    return block


def seal(conn: sqlite3.Connection, block: int) -> None:
    """Refuse every later write stamped at or below `block`; call it inside the snapshot's
    write transaction, with the reads."""
    if block > _meta_int(conn, SEALED_KEY, -1):
        _set_meta_int(conn, SEALED_KEY, block)


# -- neurons -------------------------------------------------------------------------------------


def neuron_rows(conn: sqlite3.Connection, netuid: int, block: int | None) -> list[NeuronRow]:
    where, args = visible(block)
    return conn.execute(
        "SELECT uid, hotkey, stake, validator_permit, registered_block, last_update FROM neurons "
        f"WHERE netuid = ? AND {where} ORDER BY uid LIMIT ?",
        (netuid, *args, MAX_ROWS),
    ).fetchall()


def current_uid(conn: sqlite3.Connection, netuid: int, hotkey: str) -> int | None:
    row = conn.execute(
        "SELECT uid FROM neurons WHERE netuid = ? AND hotkey = ? AND valid_to IS NULL",
        (netuid, hotkey),
    ).fetchone()
    return None if row is None else int(row[0])


def current_uids(conn: sqlite3.Connection, netuid: int) -> set[int]:
    rows = conn.execute(
        "SELECT uid FROM neurons WHERE netuid = ? AND valid_to IS NULL", (netuid,)
    ).fetchall()
    return {int(r[0]) for r in rows}


def current_neuron(conn: sqlite3.Connection, netuid: int, uid: int) -> dict[str, Any]:
    """The current version of `uid` as a column -> value mapping (`ChainError` if none)."""
    cursor = conn.execute(
        "SELECT uid, hotkey, coldkey, stake, validator_permit, registered_block, last_update "
        "FROM neurons WHERE netuid = ? AND uid = ? AND valid_to IS NULL",
        (netuid, uid),
    )
    row = cursor.fetchone()
    if row is None:
        raise ChainError(f"uid {uid} is not registered on subnet {netuid}")
    return dict(zip([d[0] for d in cursor.description], row, strict=True))


def add_neuron(
    conn: sqlite3.Connection, netuid: int, block: int, fields: Mapping[str, object]
) -> None:
    """Insert a current version of a neuron, valid from `block`."""
    columns = ("uid", "hotkey", "coldkey", "stake", "validator_permit", "registered_block")
    values = [fields[c] for c in columns]
    conn.execute(
        f"INSERT INTO neurons (netuid, {', '.join(columns)}, last_update, valid_from) "
        "VALUES (?,?,?,?,?,?,?,?,?)",
        (netuid, *values, fields.get("last_update", 0), block),
    )


def update_neuron(
    conn: sqlite3.Connection, netuid: int, uid: int, block: int, **changes: object
) -> None:
    """Replace the current version of `uid` by a copy with `changes`, valid from `block`."""
    current = current_neuron(conn, netuid, uid)
    _close(conn, "neurons", "netuid = ? AND uid = ?", (netuid, uid), block)
    add_neuron(conn, netuid, block, {**current, **changes})


def retire_neuron(conn: sqlite3.Connection, netuid: int, uid: int, block: int) -> None:
    """End the current neuron at `uid` as subtensor's `replace_neuron` does: its version, the
    weights it set and the weights set for it end at `block`; its rate-limit record goes."""
    _close(conn, "neurons", "netuid = ? AND uid = ?", (netuid, uid), block)
    _close(
        conn, "weights", "netuid = ? AND (validator_uid = ? OR uid = ?)", (netuid, uid, uid), block
    )
    conn.execute("DELETE FROM weight_sets WHERE netuid = ? AND validator_uid = ?", (netuid, uid))


# -- commitments ---------------------------------------------------------------------------------


def commitment_rows(
    conn: sqlite3.Connection, netuid: int, block: int | None, hotkey: str | None = None
) -> list[tuple[object, ...]]:
    """(hotkey, data, block) of the commitments current at `block` (or of one hotkey)."""
    where, pinned = visible(block)
    args: tuple[object, ...] = pinned
    if hotkey is not None:
        where, args = f"{where} AND hotkey = ?", (*args, hotkey)
    return conn.execute(
        f"SELECT hotkey, data, valid_from FROM commitments WHERE netuid = ? AND {where} "
        "ORDER BY hotkey LIMIT ?",
        (netuid, *args, MAX_ROWS),
    ).fetchall()


def put_commitment(
    conn: sqlite3.Connection, netuid: int, hotkey: str, data: bytes, block: int
) -> None:
    _close(conn, "commitments", "netuid = ? AND hotkey = ?", (netuid, hotkey), block)
    conn.execute(
        "INSERT INTO commitments (netuid, hotkey, data, valid_from) VALUES (?,?,?,?)",
        (netuid, hotkey, data, block),
    )


# -- weights -------------------------------------------------------------------------------------


def weight_rows(
    conn: sqlite3.Connection, netuid: int, block: int | None, validator: int | None = None
) -> list[tuple[object, ...]]:
    """(validator_uid, uid, weight) of the weights current at `block` (or of one validator)."""
    where, args = visible(block)
    if validator is not None:
        where, args = f"{where} AND validator_uid = ?", (*args, validator)
    return conn.execute(
        f"SELECT validator_uid, uid, weight FROM weights WHERE netuid = ? AND {where} "
        "ORDER BY validator_uid, uid LIMIT ?",
        (netuid, *args, MAX_ROWS),
    ).fetchall()


def put_weights(
    conn: sqlite3.Connection,
    netuid: int,
    validator: int,
    weights: Mapping[int, float],
    block: int,
) -> None:
    _close(conn, "weights", "netuid = ? AND validator_uid = ?", (netuid, validator), block)
    conn.executemany(
        "INSERT INTO weights (netuid, validator_uid, uid, weight, valid_from) VALUES (?,?,?,?,?)",
        [(netuid, validator, uid, w, block) for uid, w in sorted(weights.items())],
    )


def _close(
    conn: sqlite3.Connection, table: str, where: str, args: tuple[object, ...], block: int
) -> None:
    """End the current versions of `table` matching `where` at `block`."""
    conn.execute(
        f"UPDATE {table} SET valid_to = ? WHERE {where} AND valid_to IS NULL", (block, *args)
    )
