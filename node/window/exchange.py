"""Our update on the wire (signed, published) and the strict check every other peer's bytes get.

Gathering them under a deadline is `node.window.gather`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from substrateinterface import Keypair

from codec.errors import DecodeError
from codec.spec import ModelSpec
from node.strategy import make_format
from node.strategy.format import Decoded
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.signing import sign_update, verify_update
from protocol.stores import (
    AccessDenied,
    InvalidKey,
    ObjectNotFound,
    ObjectStore,
    ReadOnlyStoreError,
    StoreError,
)

log = logging.getLogger(f"tessera.{__name__}")

UPLOAD_RETRY_S = 1.0
"""The pause between two tries of an upload that failed for a reason that may pass (a 503, a
throttle, a dropped connection), while the window's deadline is ahead."""

FINAL = (AccessDenied, ReadOnlyStoreError, InvalidKey, ObjectNotFound)
"""Upload failures that another try does not mend (a refused key, a missing bucket)."""


@dataclass(frozen=True)
class Published:
    key: str
    n_bytes: int
    seconds: float


def max_update_bytes(spec: ModelSpec, run: RunConfig) -> int:
    """A generous cap on a legitimate update's size under the run's strategy."""
    return make_format(run, spec).max_update_bytes()


def encode_signed(
    update: Sequence[Any],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    uid: int,
    keypair: Keypair,
) -> bytes:
    """Our update (every tensor of the spec, in spec order) as signed wire bytes."""
    meta = {"run_id": run.run_id, "window": window, "uid": uid, "hotkey": keypair.ss58_address}
    return make_format(run, spec).to_bytes(
        update, meta, lambda digest: sign_update(keypair, run.run_id, window, uid, digest)
    )


def publish(
    store: ObjectStore,
    data: bytes,
    run: RunConfig,
    window: int,
    uid: int,
    hotkey: str,
    until: float | None = None,
) -> Published:
    """Upload our update of `window`, tried again until `until` (`put_until`)."""
    key = update_key(run.run_id, window, uid, hotkey)
    start = time.perf_counter()
    put_until(store, key, data, until)
    return Published(key=key, n_bytes=len(data), seconds=time.perf_counter() - start)


def put_until(store: ObjectStore, key: str, data: bytes, until: float | None) -> None:
    """Store `data` at `key` (an object only we write). A failure that may pass is tried again
    every `UPLOAD_RETRY_S` until `until` (epoch seconds, e.g. the upload deadline; None: one
    try), and before each retry the key is looked up: an earlier try stored though its answer was
    lost is not uploaded again (that would move its Last-Modified, perhaps past the deadline).
    `StoreError` once `until` has passed or for a `FINAL` failure."""
    while True:
        try:
            store.put(key, data)
            return
        except FINAL:
            raise
        except StoreError as exc:
            if until is None or time.time() + UPLOAD_RETRY_S >= until:
                raise
            log.warning("upload of %s failed (%s): trying again", key, exc)
        time.sleep(UPLOAD_RETRY_S)
        if _stored(store, key, len(data)):
            return


def _stored(store: ObjectStore, key: str, size: int) -> bool:
    """Whether `key` holds an object of `size` bytes (ours: only we write our update's key)."""
    try:
        return store.head(key).size == size
    except StoreError:
        return False


def check_update(
    data: bytes, peer_uid: int, peer_hotkey: str, run: RunConfig, spec: ModelSpec, window: int
) -> Decoded:
    """Authenticate, then strictly decode one peer's bytes; `SignatureError`/`DecodeError` if not.

    Verify first: only the (bounded) header is parsed before the signature, which covers the
    header and through its payload digest the payload, is checked; the payload is decoded only
    for an update its peer really signed for this run, window and uid. The wire format is the
    run's strategy's (`node.strategy.make_format`): another strategy's bytes fail at the frame.
    """
    verified_header(data, peer_uid, peer_hotkey, run, spec, window)
    fmt = make_format(run, spec)
    return fmt.decode(data, fmt.max_update_bytes())


def verified_header(
    data: bytes, peer_uid: int, peer_hotkey: str, run: RunConfig, spec: ModelSpec, window: int
) -> Any:
    """The header of one peer's bytes once its meta and signature are verified (the payload is
    not decoded: `check_update` or a decoding pool does that)."""
    fmt = make_format(run, spec)
    header = fmt.read_header(data, fmt.max_update_bytes())
    expected = {"run_id": run.run_id, "window": window, "uid": peer_uid, "hotkey": peer_hotkey}
    for field, value in expected.items():
        if header.meta.get(field) != value:
            raise DecodeError(f"update meta {field}={header.meta.get(field)!r}, expected {value!r}")
    verify_update(peer_hotkey, header.sig, run.run_id, window, peer_uid, fmt.signed_digest(header))
    return header


def decode_verified(data: bytes, run: RunConfig, spec: ModelSpec) -> Decoded:
    """Decode bytes that `check_update` has verified before (they are immutable: the same bytes
    decode to the same update, so a node may drop the decoded form and decode them again)."""
    fmt = make_format(run, spec)
    return fmt.decode(data, fmt.max_update_bytes())
