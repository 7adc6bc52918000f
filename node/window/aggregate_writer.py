"""A window's aggregate object, written to a file one update at a time.

The object is ``msgpack({"body": msgpack({"window", "hotkeys": {uid: ss58}, "updates": {uid:
bytes}}), "sig"})`` with the signature over the BLAKE2b-256 of ``body`` (`node.window.history`
reads it). ``hotkeys`` names the hotkey each update was verified under at the window's pinned
roster, so the history replays after a uid has been registered again under another hotkey. A validator may
apply hundreds of updates in a window, kept in spool files (`protocol.stores.spool`); packing
them with `msgpack.packb` would hold all of them, twice. Every length is known in advance (each
`Body` knows its size), so the file is written front to back, each update read back, hashed and
written in turn: the same bytes `msgpack.packb` gives (tested), with one update in memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import IO

import msgpack
from substrateinterface import Keypair

from protocol.naming import ObjectKind
from protocol.runconfig import RunConfig
from protocol.signing import payload_hasher, sign_object
from protocol.stores.spool import Body

__all__ = ["write_aggregate"]

_MAX_BIN = (1 << 32) - 1  # msgpack's bin32


def bin_header(n: int) -> bytes:
    """The msgpack header of an `n`-byte bin (the shortest, as `msgpack.packb` writes it)."""
    if not 0 <= n <= _MAX_BIN:
        raise ValueError(f"{n} bytes do not fit one msgpack bin")
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def write_aggregate(
    out: IO[bytes],
    run: RunConfig,
    window: int,
    uid: int,
    keypair: Keypair,
    updates: Mapping[int, Body],
    hotkeys: Mapping[int, str],
) -> None:
    """Write the signed aggregate of `updates` (by peer uid, each verified under `hotkeys[uid]`)
    to `out`, one update at a time."""
    pack = msgpack.Packer()
    items = sorted((int(k), v) for k, v in updates.items())
    if missing := sorted(set(updates) - set(hotkeys)):
        raise ValueError(f"no hotkey for uids {missing}")
    named = {int(k): hotkeys[k] for k in sorted(updates)}
    head = b"".join(
        [pack.pack_map_header(3), pack.pack("window"), pack.pack(window), pack.pack("hotkeys")]
    )
    head += pack.pack(named) + pack.pack("updates")
    head += pack.pack_map_header(len(items))
    entries = [(pack.pack(k) + bin_header(body.size), body) for k, body in items]
    size = len(head) + sum(len(h) + body.size for h, body in entries)
    out.write(pack.pack_map_header(2) + pack.pack("body") + bin_header(size))
    digest = payload_hasher(head)
    out.write(head)
    for h, body in entries:
        data = body.read()  # checked against its size and digest
        for part in (h, data):
            digest.update(part)
            out.write(part)
        del data
    sig = sign_object(keypair, ObjectKind.AGGREGATE, run.run_id, window, uid, digest.digest())
    out.write(pack.pack("sig") + pack.pack(sig))
