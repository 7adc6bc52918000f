"""Gathering a window's updates from other peers' buckets, under one hard deadline.

Every request goes through `protocol.stores.fetch.fetch_many`: one GET per object, a byte cap, a
minimum transfer rate after a grace period, and a wall-clock budget for the whole gather
(``run.consensus``) that no endpoint can stretch. What comes back is checked here, never trusted:

* an object stored after the deadline plus the run's clock-skew tolerance is ``late``;
* the bytes must verify and decode strictly (`node.window.exchange.check_update`).

A `Fetched` keeps the exact bytes of a verified update as its `Body`, so the window's manifest
can pin them by digest (`node.window.manifest`) and the validator can republish them: peers keep
them in memory, a validator spools them to disk while they arrive and reads each back when it
needs it (`protocol.stores.spool`, `update_request(..., spool=...)`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from codec.errors import DecodeError
from codec.spec import ModelSpec
from node.strategy.format import Decoded
from node.window.buckets import PeerBucket
from node.window.exchange import check_update, decode_verified, max_update_bytes
from node.window.pooled import PooledExchange
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError
from protocol.stores import ObjectNotFound, ObjectTooLarge, StoreError
from protocol.stores.fetch import FetchRequest, Got, fetch_many
from protocol.stores.spool import Body

log = logging.getLogger(f"tessera.{__name__}")


@dataclass(frozen=True)
class StoredUpdate:
    """A verified update kept as its `Body`: `tensors` reads and decodes it on every access.

    A validator keeps every peer's update of a window this way once it has measured it
    (`validator.fetching.fetch_uploads`), its bytes in a spool file, so it never holds more than one update's bytes and one decoded update
    at a time: its memory grows with the model, not with the number of peers (`Pieces`)."""

    header: Any
    digest: bytes
    signed_digest: bytes
    body: Body = field(repr=False)
    run: RunConfig = field(repr=False)
    spec: ModelSpec = field(repr=False)

    @classmethod
    def of(cls, decoded: Decoded, body: Body, run: RunConfig, spec: ModelSpec) -> StoredUpdate:
        return cls(decoded.header, decoded.digest, decoded.signed_digest, body, run, spec)

    @property
    def tensors(self) -> Any:
        return decode_verified(self.body.read(), self.run, self.spec).tensors


class Pieces(Mapping[int, Any]):
    """uid -> the pieces of its update, decoded when asked for; only the last one asked for is
    kept (shared with the views `only` makes). With `StoredUpdate`s, a pass over a window's
    updates in any order holds one decoded update at a time."""

    def __init__(
        self,
        updates: Mapping[int, Decoded],
        keys: Iterable[int] | None = None,
        last: dict[int, Any] | None = None,
    ) -> None:
        self._updates = updates
        self._keys = sorted(updates if keys is None else set(keys) & set(updates))
        self._last = {} if last is None else last

    def __getitem__(self, uid: int) -> Any:
        if uid not in self._keys:
            raise KeyError(uid)
        if uid not in self._last:
            self._last.clear()  # drop the previous one before decoding the next
            self._last[uid] = self._updates[uid].tensors
        return self._last[uid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def only(self, keys: Iterable[int]) -> Pieces:
        """A view of the uids in `keys`, sharing the one decoded update kept."""
        return Pieces(self._updates, keys, self._last)


@dataclass(frozen=True)
class Fetched:
    """One peer's update for a window, or why we could not use it."""

    uid: int
    update: Decoded | None
    reason: str
    body: Body | None = None  # the exact bytes, kept only when they verified and decoded
    last_modified: datetime | None = None
    n_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.update is not None

    @property
    def digest(self) -> str | None:
        """The manifest digest of the exact bytes (`node.window.manifest.bytes_digest`)."""
        return self.body.digest if self.body is not None else None


def update_request(
    peer: PeerBucket, run: RunConfig, spec: ModelSpec, window: int, spool: Path | None = None
) -> FetchRequest:
    """The request for a peer's update; with `spool` (a directory), its body goes to a file
    there named after the peer's uid."""
    key = update_key(run.run_id, window, peer.uid, peer.hotkey)
    path = None if spool is None else spool / f"update-{peer.uid}"
    return FetchRequest(peer.store, key, max_update_bytes(spec, run), path)


def fetch_all(
    requests: Mapping[Any, FetchRequest],
    run: RunConfig,
    pools: Mapping[Any, Hashable] | None = None,
    on_done: Callable[[Any, Got | StoreError], None] | None = None,
) -> dict:
    """`fetch_many` with the run's budget, minimum rate and grace (and the caller's pools and
    callback for each transfer as it ends)."""
    c = run.consensus
    return fetch_many(
        requests,
        budget_s=c.fetch_budget_s,
        min_rate_bytes_s=c.min_rate_bytes_s,
        grace_s=c.rate_grace_s,
        pools=pools,
        on_done=on_done,
    )


def fetch_reason(got: StoreError) -> str:
    """The published reason for a failed fetch: a fixed word, never the error's text.

    Reasons reach score reports; an endpoint's error text (refused, reset, TLS, timeout) would
    tell the world what listens at an address a peer named, so it goes to the local log only."""
    if isinstance(got, ObjectNotFound):
        return "missing"
    if isinstance(got, ObjectTooLarge):
        return "too large"
    return "unreachable"


def late_reason(stamp: datetime | None, run: RunConfig, deadline_s: float) -> str | None:
    """Why an object's time makes it late, or None when it is on time: stored more than the
    clock-skew tolerance after the deadline, or no time at all (a peer that hosts its own bucket
    controls the header; leaving it out must not pass the rule)."""
    if stamp is None:
        return "late: no object time"
    late_by = stamp.timestamp() - deadline_s
    if late_by > run.timing.clock_skew_tolerance_s:
        return f"late: stored {late_by:.1f}s after the deadline"
    return None


Checker = Callable[[bytes, int, str, int], Decoded]
"""(bytes, uid, hotkey, window) -> the verified update, or `DecodeError`/`SignatureError`."""


def checked(
    uid: int,
    hotkey: str,
    got: Got | StoreError,
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    deadline_s: float,
    check: Checker | None = None,
) -> Fetched:
    """What one fetch result is worth: a verified, decoded update, or the reason it is dropped
    (a spooled body is read back here). ``check`` replaces `check_update` (a decoding pool's)."""
    if isinstance(got, StoreError):
        log.info("window %d: fetching uid %d failed: %s", window, uid, got)
        return Fetched(uid, None, fetch_reason(got))
    late = late_reason(got.last_modified, run, deadline_s)
    if late is not None:
        return Fetched(uid, None, late)
    n, data = got.body.size, got.data  # read back if spooled (a `SpoolError` is ours: raised)
    try:
        if check is None:
            update = check_update(data, uid, hotkey, run, spec, window)
        else:
            update = check(data, uid, hotkey, window)
    except DecodeError as exc:
        return Fetched(uid, None, f"malformed: {exc}", n_bytes=n)
    except SignatureError as exc:
        return Fetched(uid, None, f"bad signature: {exc}", n_bytes=n)
    except Exception as exc:  # one bad peer never takes the node down
        log.exception("unexpected error checking uid %d", uid)
        return Fetched(uid, None, f"error: {type(exc).__name__}: {exc}", n_bytes=n)
    return Fetched(uid, update, "ok", got.body, got.last_modified, n)


def gather(
    peers: Sequence[PeerBucket],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    deadline_s: float,
    pooled: PooledExchange | None = None,
) -> dict[int, Fetched]:
    """The peers' updates for `window`, fetched concurrently within the run's budget, by uid.
    With ``pooled``, each payload goes to its workers (`node.window.pooled`) as soon as it has
    arrived and verified, while the others still download."""
    hotkeys = {p.uid: p.hotkey for p in peers}
    landed: dict[int, Fetched] = {}
    on_done: Callable[[int, Got | StoreError], None] | None = None
    if pooled is not None:
        pooled.begin(window)

        def on_done(uid: int, got: Got | StoreError) -> None:
            landed[uid] = checked(
                uid, hotkeys[uid], got, run, spec, window, deadline_s, pooled.check
            )

    got = fetch_all(
        {p.uid: update_request(p, run, spec, window) for p in peers}, run, None, on_done
    )
    check = pooled.check if pooled is not None else None
    out = {
        uid: landed.get(uid)
        or checked(uid, hotkeys[uid], got[uid], run, spec, window, deadline_s, check)
        for uid in sorted(hotkeys)
    }
    if pooled is not None:
        for uid, exc in pooled.rejected().items():
            out[uid] = Fetched(uid, None, f"malformed: {exc}", n_bytes=out[uid].n_bytes)
    for f in out.values():
        if not f.ok:
            log.warning("window %d: dropping uid %d: %s", window, f.uid, f.reason)
    return out
