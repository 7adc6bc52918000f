"""Signatures over published objects, made with the writer's sr25519 hotkey.

The signed message is a fixed binary layout, so two implementations cannot disagree about it::

    b"tessera/signed-object/v1\\x00"      domain tag (25 bytes)
    u8 len(kind) | kind                   ASCII object kind, e.g. b"update" (see `naming.ObjectKind`)
    run id                                16 bytes (the 32-hex run id, decoded)
    window                                u64 big-endian
    uid                                   u16 big-endian
    u8 len(digest) | digest               the object's digest, 16..64 bytes

For an update the digest is `codec.wire.header_digest`: BLAKE2b-256 of the framed wire header with
its ``sig`` field empty. That header holds the payload digest, the tensor table, the codec
parameters and the meta (run id, window, uid, hotkey), so the signature covers all of them and,
through the payload digest, every payload byte; a reader verifies it from the header alone,
before decoding the payload (`node.window.exchange.check_update`).

Verification uses the raw sr25519 check against the public key decoded from the signer's SS58
hotkey; unlike `Keypair.verify` it does not also accept signatures over the ``<Bytes>...</Bytes>``
wrapped message. Every failure (bad address, bad lengths, wrong key, any changed field) raises
`SignatureError`. Signatures are 64 bytes.
"""

from __future__ import annotations

import hashlib
import re

import sr25519
from substrateinterface import Keypair, KeypairType

from codec.errors import TesseraError
from protocol.keys import AddressError, ss58_to_public_key
from protocol.naming import MAX_UID, ObjectKind

SIGNATURE_BYTES = 64
DIGEST_MIN_BYTES = 16
DIGEST_MAX_BYTES = 64
MAX_WINDOW = (1 << 64) - 1
_DOMAIN = b"tessera/signed-object/v1\x00"
_RUN_ID_RE = re.compile(r"[0-9a-f]{32}")


class SignatureError(TesseraError, ValueError):
    """A signature is missing, malformed, or does not verify for the claimed signer and fields."""


def payload_hasher(data: bytes = b"") -> hashlib.blake2b:
    """A BLAKE2b-256 hasher fed `data`: `payload_digest` of everything it is fed."""
    return hashlib.blake2b(data, digest_size=32)


def payload_digest(data: bytes) -> bytes:
    """BLAKE2b-256 of a payload: the digest signed for objects other than updates."""
    return payload_hasher(data).digest()


def _uint(name: str, value: object, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= maximum:
        raise SignatureError(f"{name} must be an int in [0, {maximum}]")
    return value


def signed_message(
    kind: ObjectKind | str, run_id: str, window: int, uid: int, digest: bytes
) -> bytes:
    """The exact bytes that get signed for an object of `kind`."""
    try:
        kind_b = ObjectKind(kind).value.encode("ascii")
    except ValueError:
        raise SignatureError(f"unknown object kind {kind!r}") from None
    if not isinstance(run_id, str) or _RUN_ID_RE.fullmatch(run_id) is None:
        raise SignatureError("run id must be 32 lowercase hex chars")
    if not isinstance(digest, bytes) or not DIGEST_MIN_BYTES <= len(digest) <= DIGEST_MAX_BYTES:
        raise SignatureError(f"digest must be {DIGEST_MIN_BYTES}..{DIGEST_MAX_BYTES} bytes")
    return b"".join(
        (
            _DOMAIN,
            bytes([len(kind_b)]),
            kind_b,
            bytes.fromhex(run_id),
            _uint("window", window, MAX_WINDOW).to_bytes(8, "big"),
            _uint("uid", uid, MAX_UID).to_bytes(2, "big"),
            bytes([len(digest)]),
            digest,
        )
    )


def update_message(run_id: str, window: int, uid: int, digest: bytes) -> bytes:
    return signed_message(ObjectKind.UPDATE, run_id, window, uid, digest)


def sign_object(
    keypair: Keypair, kind: ObjectKind | str, run_id: str, window: int, uid: int, digest: bytes
) -> bytes:
    """Sign an object of `kind` with an sr25519 hotkey; returns the 64-byte signature."""
    if not isinstance(keypair, Keypair) or keypair.crypto_type != KeypairType.SR25519:
        raise SignatureError("signing needs an sr25519 Keypair")
    if not keypair.private_key:
        raise SignatureError("keypair has no private key")
    sig = keypair.sign(signed_message(kind, run_id, window, uid, digest))
    if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:  # pragma: no cover
        raise SignatureError("unexpected signature shape from the keypair")
    return sig


def verify_object(
    hotkey: str,
    signature: bytes,
    kind: ObjectKind | str,
    run_id: str,
    window: int,
    uid: int,
    digest: bytes,
) -> None:
    """Raise `SignatureError` unless `signature` is `hotkey`'s signature over these fields."""
    if not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise SignatureError(f"signature must be {SIGNATURE_BYTES} bytes")
    try:
        public_key = ss58_to_public_key(hotkey)
    except AddressError as e:
        raise SignatureError(f"bad signer hotkey: {e}") from None
    message = signed_message(kind, run_id, window, uid, digest)
    try:
        ok = sr25519.verify(signature, message, public_key)
    except (ValueError, TypeError):
        ok = False
    if ok is not True:
        raise SignatureError(f"signature does not verify for hotkey {hotkey}")


def sign_update(keypair: Keypair, run_id: str, window: int, uid: int, digest: bytes) -> bytes:
    """Sign a peer's update for (run, window, uid) and its header digest (`codec.wire`)."""
    return sign_object(keypair, ObjectKind.UPDATE, run_id, window, uid, digest)


def verify_update(
    hotkey: str, signature: bytes, run_id: str, window: int, uid: int, digest: bytes
) -> None:
    """Raise `SignatureError` unless `signature` is `hotkey`'s signature of this update."""
    verify_object(hotkey, signature, ObjectKind.UPDATE, run_id, window, uid, digest)
