"""The window's manifest: the lead validator's signed list of exactly which bytes a window applies.

One small JSON object per window in the lead validator's bucket (`protocol.naming.applied_key`)::

    {"body": {run_id, window, roster_block, validator_uid, validator_hotkey, fingerprint_start,
              entries: [{uid, hotkey, digest, size}, ...], rejected: {uid: reason}},
     "sig": hex sr25519 signature over BLAKE2b-256 of the body's canonical JSON}

``digest`` is BLAKE2b-256 of the update's exact bytes, so a bucket owner who serves different
bytes to different readers, or replaces its object after the validator read it, cannot make two
nodes apply different things: a node whose own copy has another digest takes the validator's copy
(the window's aggregate object holds the exact bytes of every entry). ``fingerprint_start`` is the
validator's model fingerprint at the start of the window: a node whose own differs is forked and
resyncs before applying (docs/consensus.md).

Everything read here is hostile: the object is size-capped, parsed strictly (pydantic, extra keys
refused, bounded lengths), and its signature verified against the hotkey the pinned roster gives
the lead validator's uid. Any problem is one `ManifestError`.
"""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from substrateinterface import Keypair

from codec.errors import TesseraError
from protocol.naming import ObjectKind, applied_key
from protocol.signing import (
    SignatureError,
    payload_digest,
    payload_hasher,
    sign_object,
    verify_object,
)
from protocol.stores import ObjectStore, ReadableStore, StoreError

MAX_ENTRIES = 4096
MAX_REASON_CHARS = 200


def manifest_cap(gather_size: int) -> int:
    """Largest manifest a legitimate validator publishes for this gather size (bytes)."""
    return 4096 + 512 * gather_size + 1024 * min(gather_size * 8, MAX_ENTRIES)


class ManifestError(TesseraError, ValueError):
    """A manifest is missing, malformed, or not signed by the lead validator."""


def bytes_digest(data: bytes) -> str:
    """The digest a manifest pins an update's exact bytes by (hex BLAKE2b-256, as a fetched
    `protocol.stores.spool.Body` carries it)."""
    return payload_hasher(data).hexdigest()


class Entry(BaseModel):
    """One update the window applies: whose, and its exact bytes' digest and size."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    uid: int = Field(ge=0, le=65535)
    hotkey: str = Field(min_length=40, max_length=60)
    digest: str = Field(pattern=r"^[0-9a-f]{64}$")
    size: int = Field(ge=1, le=1 << 40)


class WindowManifest(BaseModel):
    """What window ``window`` applies, as decided by the lead validator."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    run_id: str = Field(pattern=r"^[0-9a-f]{32}$")
    window: int = Field(ge=0)
    roster_block: int = Field(ge=0)
    validator_uid: int = Field(ge=0, le=65535)
    validator_hotkey: str = Field(min_length=40, max_length=60)
    fingerprint_start: str = Field(pattern=r"^[0-9a-f]{8,128}$")
    entries: tuple[Entry, ...] = Field(max_length=MAX_ENTRIES, strict=False)
    rejected: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENTRIES)

    @model_validator(mode="after")
    def _sorted_unique(self) -> WindowManifest:
        uids = [e.uid for e in self.entries]
        if uids != sorted(set(uids)):
            raise ValueError("entries must be sorted by uid, each uid once")
        if any(len(r) > MAX_REASON_CHARS for r in self.rejected.values()):
            raise ValueError("rejection reason too long")
        return self

    def canonical(self) -> bytes:
        return json.dumps(
            self.model_dump(mode="json"), sort_keys=True, separators=(",", ":")
        ).encode()

    @property
    def uids(self) -> list[int]:
        return [e.uid for e in self.entries]


def publish_manifest(store: ObjectStore, manifest: WindowManifest, keypair: Keypair) -> str:
    """Sign and publish `manifest` in our bucket, once: `ObjectExists` if a manifest of ours is
    stored for the window already (it stands; a retry never re-dates it). Returns its key."""
    body = manifest.canonical()
    sig = sign_object(
        keypair,
        ObjectKind.APPLIED,
        manifest.run_id,
        manifest.window,
        manifest.validator_uid,
        payload_digest(body),
    )
    key = applied_key(
        manifest.run_id, manifest.window, manifest.validator_uid, manifest.validator_hotkey
    )
    store.put_new(key, json.dumps({"body": json.loads(body), "sig": sig.hex()}).encode())
    return key


def read_manifest(
    store: ReadableStore, run_id: str, window: int, uid: int, hotkey: str, cap: int
) -> WindowManifest:
    """The lead validator's verified manifest of `window`; `ManifestError` on anything wrong,
    `protocol.stores.ObjectNotFound` when it is not published (yet)."""
    raw = store.get(applied_key(run_id, window, uid, hotkey), cap)
    try:
        outer = json.loads(raw)
        if not isinstance(outer, dict) or set(outer) != {"body", "sig"}:
            raise ManifestError("a manifest is exactly {body, sig}")
        if not isinstance(outer["sig"], str) or len(outer["sig"]) != 128:
            raise ManifestError("signature must be 64 bytes of hex")
        manifest = WindowManifest.model_validate(outer["body"])
        sig = bytes.fromhex(outer["sig"])
    except ManifestError:
        raise
    except (ValueError, TypeError, ValidationError) as exc:
        raise ManifestError(f"malformed manifest: {str(exc)[:200]}") from None
    expected = (run_id, window, uid, hotkey)
    found = (manifest.run_id, manifest.window, manifest.validator_uid, manifest.validator_hotkey)
    if found != expected:
        raise ManifestError(f"manifest names {found}, expected {expected}")
    try:
        verify_object(
            hotkey,
            sig,
            ObjectKind.APPLIED,
            run_id,
            window,
            uid,
            payload_digest(manifest.canonical()),
        )
    except SignatureError as exc:
        raise ManifestError(f"manifest signature: {exc}") from None
    return manifest


__all__ = [
    "Entry",
    "ManifestError",
    "StoreError",
    "WindowManifest",
    "bytes_digest",
    "manifest_cap",
    "publish_manifest",
    "read_manifest",
]
