"""Our update on the wire (signed, published) and the strict check every other peer's bytes get.

Gathering them under a deadline is `node.window.gather`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from substrateinterface import Keypair

from codec.compress import SparseTensor
from codec.errors import DecodeError
from codec.spec import ModelSpec
from codec.wire import DecodedUpdate, decode_update, encode_update, header_digest, read_header
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.signing import sign_update, verify_update
from protocol.stores import ObjectStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Published:
    key: str
    n_bytes: int
    seconds: float


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
    """Authenticate, then strictly decode one peer's bytes; `SignatureError`/`DecodeError` if not.

    Verify first: only the (bounded) header is parsed before the signature, which covers the
    header and through its payload digest the payload, is checked; the payload is decoded only
    for an update its peer really signed for this run, window and uid.
    """
    cap = max_update_bytes(spec, run)
    header, _ = read_header(data, max_bytes=cap)
    expected = {"run_id": run.run_id, "window": window, "uid": peer_uid, "hotkey": peer_hotkey}
    for field, value in expected.items():
        if header.meta.get(field) != value:
            raise DecodeError(f"update meta {field}={header.meta.get(field)!r}, expected {value!r}")
    verify_update(peer_hotkey, header.sig, run.run_id, window, peer_uid, header_digest(header))
    return decode_update(data, spec, run.codec, max_bytes=cap)
