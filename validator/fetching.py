"""Fetch every peer's update (and its fingerprint) for a window, concurrently, never raising.

The drop rule is `node.window.exchange.fetch` itself — the same late rule (LastModified against the
deadline plus the run's clock-skew tolerance), byte cap, strict decoding and signature check that
every honest peer applies — so the validator keeps exactly the set the peers keep. A thin
recording wrapper around the peer's read-only store keeps what `fetch` saw (the object time and
the exact bytes) for copy ordering and for the published aggregate.

Each peer gets `timeout_s` in total; a peer whose store hangs is reported as ``unreachable`` and
the window goes on without it (its thread is abandoned, never joined).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import datetime

from codec.spec import ModelSpec
from node.window.buckets import PeerBucket
from node.window.exchange import Fetched, fetch
from protocol.naming import fingerprint_key
from protocol.runconfig import RunConfig
from protocol.stores import ObjectInfo, ReadableStore, StoreError

log = logging.getLogger(__name__)

MAX_FINGERPRINT_BYTES = 4096


class _Recording(ReadableStore):
    """Delegates to a peer's store and remembers the last `head` and `get` results."""

    def __init__(self, inner: ReadableStore) -> None:
        self.inner = inner
        self.info: ObjectInfo | None = None
        self.data: bytes | None = None

    @property
    def location(self) -> str:
        return self.inner.location

    @property
    def read_only(self) -> bool:
        return True

    def get(self, key: str, max_bytes: int) -> bytes:
        self.data = self.inner.get(key, max_bytes)
        return self.data

    def get_to_file(self, key: str, path: str | os.PathLike[str], max_bytes: int) -> int:
        return self.inner.get_to_file(key, path, max_bytes)

    def head(self, key: str) -> ObjectInfo:
        self.info = self.inner.head(key)
        return self.info

    def list(self, prefix: str = "", *, limit: int = 100_000) -> list[ObjectInfo]:
        return self.inner.list(prefix, limit=limit)


@dataclass(frozen=True)
class Upload:
    """One peer's update for the window as fetched: `node.window.exchange.Fetched` plus what it saw."""

    uid: int
    hotkey: str
    fetched: Fetched
    data: bytes | None  # the exact bytes (kept only when they decoded and verified)
    last_modified: datetime | None
    fingerprint: str | None  # the peer's published fingerprint for window - 1, if any


def _peer_fingerprint(peer: PeerBucket, run: RunConfig, window: int) -> str | None:
    if window < 0:
        return None
    try:
        key = fingerprint_key(run.run_id, window, peer.uid, peer.hotkey)
        body = json.loads(peer.store.get(key, MAX_FINGERPRINT_BYTES))
    except (StoreError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("run_id") != run.run_id:
        return None
    if body.get("window") != window or body.get("uid") != peer.uid:
        return None
    fp = body.get("fingerprint")
    return fp if isinstance(fp, str) and len(fp) <= 128 else None


def fetch_one(
    peer: PeerBucket, run: RunConfig, spec: ModelSpec, window: int, deadline_s: float
) -> Upload:
    rec = _Recording(peer.store)
    fetched = fetch(PeerBucket(peer.uid, peer.hotkey, rec), run, spec, window, deadline_s)
    return Upload(
        uid=peer.uid,
        hotkey=peer.hotkey,
        fetched=fetched,
        data=rec.data if fetched.ok else None,
        last_modified=rec.info.last_modified if rec.info is not None else None,
        fingerprint=_peer_fingerprint(peer, run, window - 1),
    )


def _unreachable(peer: PeerBucket, reason: str) -> Upload:
    return Upload(peer.uid, peer.hotkey, Fetched(peer.uid, None, reason), None, None, None)


def fetch_all(
    peers: Sequence[PeerBucket],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    deadline_s: float,
    timeout_s: float,
    workers: int = 8,
) -> dict[int, Upload]:
    """Every peer's `Upload`, keyed by uid; hung or crashing peers become `unreachable`."""
    if not peers:
        return {}
    pool = ThreadPoolExecutor(max_workers=min(workers, len(peers)), thread_name_prefix="fetch")
    futures: dict[int, Future[Upload]] = {
        p.uid: pool.submit(fetch_one, p, run, spec, window, deadline_s) for p in peers
    }
    rounds = -(-len(peers) // min(workers, len(peers)))  # each peer gets timeout_s of its own
    wait(futures.values(), timeout=timeout_s * rounds)
    pool.shutdown(wait=False, cancel_futures=True)
    out: dict[int, Upload] = {}
    for peer in peers:
        fut = futures[peer.uid]
        if not fut.done() or fut.cancelled():
            out[peer.uid] = _unreachable(peer, f"unreachable: no answer within {timeout_s:.0f}s")
            continue
        exc = fut.exception()
        if exc is not None:  # fetch never raises; belt and braces
            log.warning("window %d: uid %d: %s", window, peer.uid, exc)
            out[peer.uid] = _unreachable(peer, f"error: {type(exc).__name__}")
            continue
        out[peer.uid] = fut.result()
    return out
