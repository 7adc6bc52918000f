"""Publishing our update and gathering everyone else's, with every peer's bytes treated as hostile."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from substrateinterface import Keypair

from codec.compress import SparseTensor
from codec.errors import DecodeError
from codec.spec import ModelSpec
from codec.wire import DecodedUpdate, decode_update, encode_update
from node.window.buckets import PeerBucket
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.signing import SignatureError, sign_update, verify_update
from protocol.stores import ObjectNotFound, ObjectStore, ObjectTooLarge, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    key: str
    n_bytes: int
    seconds: float


@dataclass(frozen=True)
class Fetched:
    """One peer's update for a window, or why we could not use it."""

    uid: int
    update: DecodedUpdate | None
    reason: str
    n_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.update is not None


def max_update_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """A generous cap on a legitimate update's size: 32 bits per kept entry, plus 1 MiB."""
    kept = spec.numel * run.codec.k // run.codec.chunk_size + len(spec.tensors) * run.codec.k
    return 4 * kept + (1 << 20)


def encode_signed(
    sparse: Sequence[SparseTensor],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    uid: int,
    keypair: Keypair,
) -> bytes:
    meta = {"run_id": run.run_id, "window": window, "uid": uid, "hotkey": keypair.ss58_address}
    return encode_update(
        sparse,
        run.codec,
        spec,
        meta=meta,
        sign=lambda digest: sign_update(keypair, run.run_id, window, uid, digest),
    )


def publish(
    store: ObjectStore, data: bytes, run: RunConfig, window: int, uid: int, hotkey: str
) -> Published:
    key = update_key(run.run_id, window, uid, hotkey)
    start = time.perf_counter()
    store.put(key, data)
    return Published(key=key, n_bytes=len(data), seconds=time.perf_counter() - start)


def check_update(
    data: bytes, peer_uid: int, peer_hotkey: str, run: RunConfig, spec: ModelSpec, window: int
) -> DecodedUpdate:
    """Strictly decode and authenticate one peer's bytes; `DecodeError`/`SignatureError` if not."""
    update = decode_update(data, spec, run.codec, max_bytes=max_update_bytes(spec, run))
    meta = update.header.meta
    expected = {"run_id": run.run_id, "window": window, "uid": peer_uid, "hotkey": peer_hotkey}
    for field, value in expected.items():
        if meta.get(field) != value:
            raise DecodeError(f"update meta {field}={meta.get(field)!r}, expected {value!r}")
    verify_update(peer_hotkey, update.header.sig, run.run_id, window, peer_uid, update.digest)
    return update


def fetch(
    peer: PeerBucket, run: RunConfig, spec: ModelSpec, window: int, deadline_s: float
) -> Fetched:
    """Download, decode and verify one peer's update; never raises.

    An object stored after `deadline_s` (epoch seconds) plus the run's clock-skew tolerance is
    late and dropped, whatever its content: every node applies the same rule to the same
    timestamps, so they all keep the same set.
    """
    key = update_key(run.run_id, window, peer.uid, peer.hotkey)
    try:
        info = peer.store.head(key)
        late_by = info.last_modified.timestamp() - deadline_s
        if late_by > run.timing.clock_skew_tolerance_s:
            return Fetched(peer.uid, None, f"late: stored {late_by:.1f}s after the deadline")
        data = peer.store.get(key, max_update_bytes(spec, run))
    except ObjectNotFound:
        return Fetched(peer.uid, None, "missing")
    except ObjectTooLarge as exc:
        return Fetched(peer.uid, None, f"too large: {exc}")
    except StoreError as exc:
        return Fetched(peer.uid, None, f"unreachable: {exc}")
    try:
        return Fetched(
            peer.uid, check_update(data, peer.uid, peer.hotkey, run, spec, window), "ok", len(data)
        )
    except DecodeError as exc:
        return Fetched(peer.uid, None, f"malformed: {exc}", len(data))
    except SignatureError as exc:
        return Fetched(peer.uid, None, f"bad signature: {exc}", len(data))
    except Exception as exc:  # one bad peer never takes the node down
        log.exception("unexpected error checking uid %d", peer.uid)
        return Fetched(peer.uid, None, f"error: {type(exc).__name__}: {exc}", len(data))


def gather(
    peers: Sequence[PeerBucket],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    deadline_s: float,
    workers: int = 8,
) -> list[Fetched]:
    """Fetch the selected peers' updates concurrently; results sorted by uid."""
    if not peers:
        return []
    with ThreadPoolExecutor(max_workers=min(workers, len(peers))) as pool:
        results = list(pool.map(lambda p: fetch(p, run, spec, window, deadline_s), peers))
    for r in results:
        if not r.ok:
            log.warning("window %d: dropping uid %d: %s", window, r.uid, r.reason)
    return sorted(results, key=lambda r: r.uid)
