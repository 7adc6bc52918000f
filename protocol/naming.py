"""Object names: one scheme for everything a node puts in its bucket.

Every object of a run sits under the run id, then the window, then its kind::

    {run_id}/w{window:010d}/{kind}/{uid:05d}-{hotkey}{part}.{ext}

    run_id   32 lowercase hex chars (`RunConfig.run_id`)
    window   the outer step, 10 zero-padded digits (lexicographic order = numeric order)
    kind     update | aggregate | checkpoint | scores | fingerprint | manifest | applied
    uid      the writer's subnet uid, 5 zero-padded digits (0..65535)
    hotkey   the writer's SS58 (format 42) hotkey address, checksum-verified
    part     only for checkpoint: ``.p{part:05d}`` (shard index 0..99999)
    ext      fixed per kind: update/aggregate -> ``tsr``, checkpoint -> ``ckpt``,
             scores/fingerprint/manifest/applied -> ``json``

    kind         written by   content
    update       peer         the compressed pseudo-gradient Δ̂ for the window
    aggregate    validator    the aggregate it applied at the end of the window
    checkpoint   validator    model shard(s) after the window's outer step
    manifest     validator    index of a checkpoint: parts, sizes, digests
    applied      validator    the window's signed list of (uid, digest) every node applies
    scores       validator    per-peer score breakdown for the window
    fingerprint  any node     parameter fingerprint after the window's outer step

Examples::

    3f2a...e9/w0000000042/update/00017-5GrwvaEF5zXb26Fz9rcQpDWS57CtERHpNehXCPcNoHGKutQY.tsr
    3f2a...e9/w0000000042/checkpoint/00003-5F...Y.p00002.ckpt

Listing everything of a window is one prefix query (`window_prefix`), one kind of a window is
`kind_prefix`. Both uid and hotkey are in the name because uids are recycled on deregistration.
Parsers (`parse_key`) accept exactly the strings the renderers produce and raise `NamingError` for
anything else: wrong lengths, unknown kinds, extension/kind mismatches, non-canonical numbers,
bad SS58 checksums, stray characters or separators, keys longer than `MAX_KEY_LENGTH`.
"""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from codec.errors import TesseraError
from protocol.keys import AddressError, ss58_to_public_key

MAX_WINDOW = 10**10 - 1
MAX_UID = 65535
MAX_PART = 99999
MAX_KEY_LENGTH = 160


class NamingError(TesseraError, ValueError):
    """An object name (or a part of one) is malformed."""


class ObjectKind(StrEnum):
    UPDATE = "update"
    AGGREGATE = "aggregate"
    CHECKPOINT = "checkpoint"
    SCORES = "scores"
    FINGERPRINT = "fingerprint"
    MANIFEST = "manifest"
    APPLIED = "applied"


EXTENSIONS: dict[ObjectKind, str] = {
    ObjectKind.UPDATE: "tsr",
    ObjectKind.AGGREGATE: "tsr",
    ObjectKind.CHECKPOINT: "ckpt",
    ObjectKind.SCORES: "json",
    ObjectKind.FINGERPRINT: "json",
    ObjectKind.MANIFEST: "json",
    ObjectKind.APPLIED: "json",
}

_KEY_RE = re.compile(
    r"(?P<run_id>[0-9a-f]{32})/w(?P<window>[0-9]{10})/(?P<kind>[a-z]{1,16})/"
    r"(?P<uid>[0-9]{5})-(?P<hotkey>[1-9A-HJ-NP-Za-km-z]{47,48})"
    r"(?:\.p(?P<part>[0-9]{5}))?\.(?P<ext>[a-z]{1,8})"
)
_RUN_ID_RE = re.compile(r"[0-9a-f]{32}")


class ObjectKey(BaseModel):
    """A parsed object name. `str(key)` renders it; `parse_key` is the strict inverse."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    run_id: str
    window: int = Field(ge=0, le=MAX_WINDOW)
    kind: ObjectKind
    uid: int = Field(ge=0, le=MAX_UID)
    hotkey: str
    part: int | None = Field(None, ge=0, le=MAX_PART)

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str) -> str:
        if _RUN_ID_RE.fullmatch(v) is None:
            raise ValueError("run id must be 32 lowercase hex chars")
        return v

    @field_validator("hotkey")
    @classmethod
    def _hotkey(cls, v: str) -> str:
        ss58_to_public_key(v)
        return v

    @model_validator(mode="after")
    def _part_only_for_checkpoints(self) -> ObjectKey:
        if (self.kind is ObjectKind.CHECKPOINT) != (self.part is not None):
            raise ValueError("a part index is required for checkpoints and forbidden otherwise")
        return self

    @property
    def extension(self) -> str:
        return EXTENSIONS[self.kind]

    def render(self) -> str:
        part = "" if self.part is None else f".p{self.part:05d}"
        return (
            f"{self.run_id}/w{self.window:010d}/{self.kind.value}/"
            f"{self.uid:05d}-{self.hotkey}{part}.{self.extension}"
        )

    def __str__(self) -> str:
        return self.render()


def object_key(
    run_id: str, window: int, kind: ObjectKind | str, uid: int, hotkey: str, part: int | None = None
) -> str:
    """Render the name of one object; `NamingError` if any component is invalid."""
    return _build(run_id, window, kind, uid, hotkey, part).render()


def _build(
    run_id: object, window: object, kind: object, uid: object, hotkey: object, part: object
) -> ObjectKey:
    try:
        fields = {
            "run_id": run_id,
            "window": window,
            "kind": ObjectKind(kind) if isinstance(kind, str) else kind,
            "uid": uid,
        }
        return ObjectKey.model_validate({**fields, "hotkey": hotkey, "part": part})
    except AddressError as e:
        raise NamingError(f"bad hotkey: {e}") from None
    except (ValidationError, ValueError, TypeError) as e:
        raise NamingError(f"invalid object name component: {_short(e)}") from None


def _short(e: Exception) -> str:
    if isinstance(e, ValidationError):
        return "; ".join(f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors())
    return str(e)


def update_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    return object_key(run_id, window, ObjectKind.UPDATE, uid, hotkey)


def aggregate_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    return object_key(run_id, window, ObjectKind.AGGREGATE, uid, hotkey)


def checkpoint_key(run_id: str, window: int, uid: int, hotkey: str, part: int = 0) -> str:
    return object_key(run_id, window, ObjectKind.CHECKPOINT, uid, hotkey, part)


def manifest_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    return object_key(run_id, window, ObjectKind.MANIFEST, uid, hotkey)


def applied_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    return object_key(run_id, window, ObjectKind.APPLIED, uid, hotkey)


def scores_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    return object_key(run_id, window, ObjectKind.SCORES, uid, hotkey)


def fingerprint_key(run_id: str, window: int, uid: int, hotkey: str) -> str:
    return object_key(run_id, window, ObjectKind.FINGERPRINT, uid, hotkey)


def run_prefix(run_id: str) -> str:
    """``{run_id}/``: everything of a run."""
    if not isinstance(run_id, str) or _RUN_ID_RE.fullmatch(run_id) is None:
        raise NamingError("run id must be 32 lowercase hex chars")
    return f"{run_id}/"


def window_prefix(run_id: str, window: int) -> str:
    """``{run_id}/w{window:010d}/``: everything of one window."""
    if isinstance(window, bool) or not isinstance(window, int) or not 0 <= window <= MAX_WINDOW:
        raise NamingError(f"window must be an int in [0, {MAX_WINDOW}]")
    return f"{run_prefix(run_id)}w{window:010d}/"


def kind_prefix(run_id: str, window: int, kind: ObjectKind | str) -> str:
    """``{run_id}/w{window:010d}/{kind}/``: one kind of object in one window."""
    try:
        kind = ObjectKind(kind)
    except ValueError:
        raise NamingError(f"unknown object kind {kind!r}") from None
    return f"{window_prefix(run_id, window)}{kind.value}/"


def parse_key(key: object) -> ObjectKey:
    """Strictly parse an object name; `NamingError` for anything `object_key` would not produce."""
    if not isinstance(key, str):
        raise NamingError(f"object name must be str, got {type(key).__name__}")
    if len(key) > MAX_KEY_LENGTH:
        raise NamingError("object name too long")
    m = _KEY_RE.fullmatch(key)
    if m is None:
        raise NamingError(f"malformed object name {key[:MAX_KEY_LENGTH]!r}")
    try:
        kind = ObjectKind(m["kind"])
    except ValueError:
        raise NamingError(f"unknown object kind {m['kind']!r}") from None
    if m["ext"] != EXTENSIONS[kind]:
        raise NamingError(f"{kind.value} objects end in .{EXTENSIONS[kind]}, not .{m['ext']}")
    part = None if m["part"] is None else int(m["part"])
    parsed = _build(m["run_id"], int(m["window"]), kind, int(m["uid"]), m["hotkey"], part)
    if parsed.render() != key:  # belt and braces: the scheme has exactly one spelling per key
        raise NamingError(f"non-canonical object name {key!r}")
    return parsed


def parse_key_expecting(
    key: object,
    *,
    run_id: str,
    window: int | None = None,
    kind: ObjectKind | str | None = None,
    uid: int | None = None,
    hotkey: str | None = None,
) -> ObjectKey:
    """`parse_key`, then require the given components to match (`NamingError` otherwise)."""
    parsed = parse_key(key)
    expected: dict[str, object] = {"run_id": run_id}
    if window is not None:
        expected["window"] = window
    if kind is not None:
        expected["kind"] = ObjectKind(kind)
    if uid is not None:
        expected["uid"] = uid
    if hotkey is not None:
        expected["hotkey"] = hotkey
    for field, want in expected.items():
        got = getattr(parsed, field)
        if got != want:
            raise NamingError(f"object {key!r}: {field} is {got!r}, expected {want!r}")
    return parsed
