"""The on-chain bucket commitment: where a node's objects are and the read key to fetch them.

Bittensor's ``Commitments::set_commitment(netuid, info)`` stores ``CommitmentInfo { fields:
BoundedVec<Data, MaxFields> }``; a ``Data::Raw`` field holds at most 128 bytes (SCALE variants
``Raw0``..``Raw128``), and older runtimes allow a single field (``MaxFields = 1``, newer 3). So a
commitment is one compact binary **body**, normally a single Raw field of <= 128 bytes; a body
that does not fit is split into consecutive 128-byte fields (every field but the last exactly 128
bytes, at most `MAX_FIELDS` of them) and the reader concatenates them again.

Body, version 1 (all lengths in bytes)::

    offset  size  field
    0       1     header = VERSION << 4 | provider   (VERSION = 1)
    --- provider 1 = r2, 2 = r2-eu (Cloudflare R2, default / EU jurisdiction endpoint):
    1       16    R2 account id        (32 lowercase hex chars, as raw bytes)
    17      16    read access key id   (32 lowercase hex chars, as raw bytes)
    33      32    read secret          (64 lowercase hex chars, as raw bytes)
    65      3-63  bucket name          (ASCII, the rest of the body)   => 68..128 bytes, 1 field
    --- provider 3 = s3 (AWS S3, endpoint https://s3.<region>.amazonaws.com):
    1       1+n   region               (string, see below)
    ..      1+n   read access key id   (string)
    ..      1+n   read secret          (string)
    ..      3-63  bucket name          (ASCII, the rest of the body)
    --- provider 6 = local (the embedded file:// store of a simulation; same layout as s3,
        the region field is conventionally "local"; refused unless local mode is allowed)
    --- provider 4 = https, 5 = http (any S3-compatible endpoint, e.g. MinIO):
    1       1+n   host[:port]          (u8 length 1..255, then lowercase ASCII)
    ..      1+n   region               (string)
    ..      1+n   read access key id   (string)
    ..      1+n   read secret          (string)
    ..      3-63  bucket name          (ASCII, the rest of the body)

    string := tag (1 byte) | data (n bytes)
        tag bits 7..6 = encoding: 0 printable ASCII (0x21..0x7e) as is; 1 lowercase hex text
        stored as bytes (text length 2n); 2 standard base64 text without padding stored decoded
        (text length 4n/3, n a multiple of 3); 3 is reserved.
        tag bits 5..0 = n, 1..63.

The renderer always picks the shortest encoding (hex, then base64, then ASCII), and the parser
re-renders what it decoded and rejects any body that is not byte-identical, so every commitment
has exactly one valid encoding. Sizes: R2 68..128 bytes (one field for every legal bucket name);
AWS with a 20-char key id and a 40-char secret: 1 + (1+len(region)) + 16 + 31 + len(bucket),
e.g. 73 bytes for ``us-east-1`` and a 15-char bucket, at most 126 bytes for any region of up to
14 chars; endpoint providers: 1 + (1+len(host)) + (1+len(region)) + key + secret + bucket, e.g.
62 bytes for ``127.0.0.1:9000``, ``us-east-1``, ``minioadmin``/``minioadmin`` and a 14-char bucket;
only long host names push a body into a second or third field.

Only `ReadCredentials` can go into a commitment: handing a `WriteCredentials` anywhere here raises
`SecretLeakError`. Every malformed input to `parse_commitment` raises `CommitmentError` and only
that. By default the parser refuses what `protocol.endpoints.EndpointPolicy` can refuse without a
lookup: plain-http endpoints, ports other than 443, non-canonical numeric hosts (``127.1``,
``0x7f.1``), IP literals that are not globally routable, ``localhost`` and single-label names
(pass ``allow_private_endpoints=True`` for local simulations). That a DNS name resolves only to
routable addresses is checked, and the address pinned, when a store connects
(`protocol.stores.pinned`, `protocol.stores.fetch`).
"""

from __future__ import annotations

import base64
import ipaddress
import re
from collections.abc import Sequence
from enum import IntEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from codec.errors import TesseraError
from protocol.credentials import ReadCredentials, SecretLeakError, WriteCredentials
from protocol.endpoints import EndpointPolicy, EndpointRefused, split_host

VERSION = 1
RAW_FIELD_BYTES = 128
"""Capacity of one ``Data::Raw`` field in pallet-commitments."""
MAX_FIELDS = 3
MAX_COMMITMENT_BYTES = RAW_FIELD_BYTES * MAX_FIELDS

_ENC_ASCII, _ENC_HEX, _ENC_B64 = 0, 1, 2
_MAX_STR = 63
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX_TEXT = re.compile(r"(?:[0-9a-f]{2})+")
_B64_TEXT = re.compile(r"(?:[A-Za-z0-9+/]{4})+")
_PRINTABLE = re.compile(r"[\x21-\x7e]+")
_REGION = re.compile(r"[a-z][a-z0-9-]{0,31}")
_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
_HOST = re.compile(rf"(?P<name>{_LABEL}(?:\.{_LABEL})*)(?::(?P<port>[1-9][0-9]{{0,4}}))?")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_BUCKET_CHARS = re.compile(r"[a-z0-9.-]+")
_HOST_CHARS = re.compile(r"[a-z0-9.:-]+")


class CommitmentError(TesseraError, ValueError):
    """A commitment body or field list is malformed, non-canonical, oversized or unsafe."""


class Provider(IntEnum):
    R2 = 1
    R2_EU = 2
    S3 = 3
    HTTPS = 4
    HTTP = 5
    LOCAL = 6
    """The embedded `file://` store of a simulation on one machine (refused outside local mode)."""

    @property
    def keeps_clock(self) -> bool:
        """Whether an object's Last-Modified comes from a clock the uploader does not control:
        Cloudflare R2 and AWS S3 stamp objects with their own clock on every PUT, and the
        embedded store of a simulation is the simulation's own file system. A self-hosted
        ``https``/``http`` endpoint answers whatever its owner wants (docs/incentives.md)."""
        return self in (Provider.R2, Provider.R2_EU, Provider.S3, Provider.LOCAL)


_R2 = (Provider.R2, Provider.R2_EU)
_ENDPOINT = (Provider.HTTPS, Provider.HTTP)


class BucketCommitment(BaseModel):
    """Where a node's bucket is and the read-only key that opens it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    provider: Provider
    bucket: str
    credentials: ReadCredentials
    account_id: str | None = None
    """Cloudflare account id (R2 providers only)."""
    region: str | None = None
    """Signing region (s3/https/http only; R2 signs with ``auto``)."""
    host: str | None = None
    """``host[:port]`` of an S3-compatible endpoint (https/http only), lowercase."""

    @model_validator(mode="before")
    @classmethod
    def _no_write_keys(cls, data: Any) -> Any:
        values = data.values() if isinstance(data, dict) else (data,)
        if any(isinstance(v, WriteCredentials) for v in values):
            raise SecretLeakError("write credentials can never go into a commitment")
        return data

    @model_validator(mode="after")
    def _check(self) -> BucketCommitment:
        p = self.provider
        if type(self.credentials) is not ReadCredentials:
            raise SecretLeakError("a commitment carries ReadCredentials only")
        _check_bucket(self.bucket, allow_dots=p not in _R2)
        if p in _R2:
            if self.account_id is None or _HEX32.fullmatch(self.account_id) is None:
                raise ValueError("R2 account id must be 32 lowercase hex chars")
            if _HEX32.fullmatch(self.credentials.access_key_id) is None:
                raise ValueError("R2 access key id must be 32 lowercase hex chars")
            if _HEX64.fullmatch(self.credentials.secret_access_key) is None:
                raise ValueError("R2 secret must be 64 lowercase hex chars")
            if self.region is not None or self.host is not None:
                raise ValueError("R2 commitments carry neither region nor host")
            return self
        if self.account_id is not None:
            raise ValueError("only R2 commitments carry an account id")
        if self.region is None or _REGION.fullmatch(self.region) is None:
            raise ValueError("region must match [a-z][a-z0-9-]{0,31}")
        for value in (self.credentials.access_key_id, self.credentials.secret_access_key):
            _encode_str(value)  # raises if it cannot be carried
        if p in (Provider.S3, Provider.LOCAL):
            if self.host is not None:
                raise ValueError("s3 and local commitments carry no host")
            return self
        if self.host is None:
            raise ValueError("https/http commitments need a host")
        _check_host(self.host)
        return self

    @property
    def region_name(self) -> str:
        return "auto" if self.provider in _R2 else str(self.region)

    @property
    def endpoint_url(self) -> str:
        p = self.provider
        if p is Provider.R2:
            return f"https://{self.account_id}.r2.cloudflarestorage.com"
        if p is Provider.R2_EU:
            return f"https://{self.account_id}.eu.r2.cloudflarestorage.com"
        if p is Provider.S3:
            return f"https://s3.{self.region}.amazonaws.com"
        if p is Provider.LOCAL:
            return "file://"
        scheme = "https" if p is Provider.HTTPS else "http"
        return f"{scheme}://{self.host}"

    def __repr__(self) -> str:  # the read secret is public by design, but keep logs short
        return (
            f"BucketCommitment(provider={self.provider.name}, endpoint={self.endpoint_url!r}, "
            f"bucket={self.bucket!r}, access_key_id={self.credentials.access_key_id!r})"
        )

    __str__ = __repr__


def _check_bucket(bucket: str, *, allow_dots: bool) -> None:
    if _BUCKET.fullmatch(bucket) is None:
        raise ValueError("bucket must be 3-63 chars of [a-z0-9.-], alphanumeric at both ends")
    if not allow_dots and "." in bucket:
        raise ValueError("R2 bucket names cannot contain dots")
    if ".." in bucket or ".-" in bucket or "-." in bucket:
        raise ValueError("bucket has an empty or dashed label")
    try:
        ipaddress.IPv4Address(bucket)
    except ValueError:
        return
    raise ValueError("bucket cannot look like an IP address")


def _check_host(host: str) -> None:
    if len(host) > 255:
        raise ValueError("host too long")
    m = _HOST.fullmatch(host)
    if m is None or len(m["name"]) > 253:
        raise ValueError("host must be lowercase host[:port] with DNS labels or an IPv4 address")
    if m["port"] is not None and int(m["port"]) > 65535:
        raise ValueError("port out of range")


# -- strings ---------------------------------------------------------------------------------


def _encode_str(text: str) -> bytes:
    if _HEX_TEXT.fullmatch(text) and len(text) // 2 <= _MAX_STR:
        return bytes([_ENC_HEX << 6 | len(text) // 2]) + bytes.fromhex(text)
    if _B64_TEXT.fullmatch(text) and len(text) * 3 // 4 <= _MAX_STR:
        data = base64.b64decode(text, validate=True)
        return bytes([_ENC_B64 << 6 | len(data)]) + data
    if _PRINTABLE.fullmatch(text) and len(text) <= _MAX_STR:
        return bytes([_ENC_ASCII << 6 | len(text)]) + text.encode("ascii")
    raise ValueError(
        "string cannot be carried in a commitment (printable ASCII up to 63 chars, "
        "lowercase hex up to 126, base64 up to 84)"
    )


class _Reader:
    def __init__(self, body: bytes) -> None:
        self.body, self.pos = body, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.body):
            raise CommitmentError("commitment truncated")
        out = self.body[self.pos : self.pos + n]
        self.pos += n
        return out

    def string(self) -> str:
        tag = self.take(1)[0]
        enc, n = tag >> 6, tag & 0x3F
        if n == 0:
            raise CommitmentError("empty string field")
        data = self.take(n)
        if enc == _ENC_HEX:
            return data.hex()
        if enc == _ENC_B64:
            if n % 3:
                raise CommitmentError("base64 field length must be a multiple of 3")
            return base64.b64encode(data).decode("ascii")
        if enc == _ENC_ASCII:
            return _ascii(data, _PRINTABLE)
        raise CommitmentError("reserved string encoding")

    def host(self) -> str:
        n = self.take(1)[0]
        if n == 0:
            raise CommitmentError("empty host")
        return _ascii(self.take(n), _HOST_CHARS)

    def rest(self) -> bytes:
        return self.take(len(self.body) - self.pos)


def _ascii(data: bytes, allowed: re.Pattern[str]) -> str:
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        raise CommitmentError("non-ASCII bytes in a text field") from None
    if allowed.fullmatch(text) is None:
        raise CommitmentError("disallowed characters in a text field")
    return text


# -- render / parse --------------------------------------------------------------------------


def render_commitment(commitment: BucketCommitment) -> bytes:
    """The canonical body (1..`MAX_COMMITMENT_BYTES` bytes)."""
    if not isinstance(commitment, BucketCommitment):
        raise TypeError(f"expected BucketCommitment, got {type(commitment).__name__}")
    creds = commitment.credentials
    if type(creds) is not ReadCredentials:  # e.g. smuggled in with model_construct
        raise SecretLeakError("a commitment carries ReadCredentials only")
    p = commitment.provider
    out = bytearray([VERSION << 4 | int(p)])
    try:
        if p in _R2:
            out += bytes.fromhex(str(commitment.account_id))
            out += bytes.fromhex(creds.access_key_id)
            out += bytes.fromhex(creds.secret_access_key)
        else:
            if p in _ENDPOINT:
                host = str(commitment.host).encode("ascii")
                out += bytes([len(host)]) + host
            out += _encode_str(str(commitment.region))
            out += _encode_str(creds.access_key_id)
            out += _encode_str(creds.secret_access_key)
        out += commitment.bucket.encode("ascii")
    except (ValueError, TypeError) as e:
        raise CommitmentError(f"commitment cannot be rendered: {e}") from None
    if len(out) > MAX_COMMITMENT_BYTES:
        raise CommitmentError(
            f"commitment is {len(out)} bytes, more than {MAX_FIELDS} fields of {RAW_FIELD_BYTES}"
        )
    return bytes(out)


def commitment_fields(commitment: BucketCommitment) -> tuple[bytes, ...]:
    """The body split into ``Data::Raw`` fields: one field whenever the body is <= 128 bytes."""
    body = render_commitment(commitment)
    return tuple(body[i : i + RAW_FIELD_BYTES] for i in range(0, len(body), RAW_FIELD_BYTES))


def join_commitment_fields(fields: Sequence[bytes]) -> bytes:
    """Reassemble a body from on-chain Raw fields, checking the split rule strictly."""
    if isinstance(fields, bytes | bytearray | str) or not 1 <= len(fields) <= MAX_FIELDS:
        raise CommitmentError(f"a commitment has 1..{MAX_FIELDS} fields")
    for i, f in enumerate(fields):
        if not isinstance(f, bytes | bytearray):
            raise CommitmentError("commitment fields must be bytes")
        last = i == len(fields) - 1
        if (not last and len(f) != RAW_FIELD_BYTES) or not 1 <= len(f) <= RAW_FIELD_BYTES:
            raise CommitmentError("every commitment field but the last must hold 128 bytes")
    return b"".join(bytes(f) for f in fields)


def parse_commitment(data: bytes, *, allow_private_endpoints: bool = False) -> BucketCommitment:
    """Strictly parse a commitment body; `CommitmentError` for anything malformed or unsafe."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise CommitmentError(f"commitment must be bytes, got {type(data).__name__}")
    body = bytes(data)
    if not 1 <= len(body) <= MAX_COMMITMENT_BYTES:
        raise CommitmentError(f"commitment must be 1..{MAX_COMMITMENT_BYTES} bytes")
    header = body[0]
    if header >> 4 != VERSION:
        raise CommitmentError(f"unsupported commitment version {header >> 4}")
    try:
        provider = Provider(header & 0x0F)
    except ValueError:
        raise CommitmentError(f"unknown provider {header & 0x0F}") from None

    r = _Reader(body)
    r.take(1)
    fields: dict[str, Any] = {"provider": provider}
    if provider in _R2:
        fields["account_id"] = r.take(16).hex()
        key_id, secret = r.take(16).hex(), r.take(32).hex()
    else:
        if provider in _ENDPOINT:
            fields["host"] = r.host()
        fields["region"] = r.string()
        key_id, secret = r.string(), r.string()
    bucket = r.rest()
    if not bucket:
        raise CommitmentError("commitment has no bucket name")
    fields["bucket"] = _ascii(bucket, _BUCKET_CHARS)

    try:
        creds = ReadCredentials(access_key_id=key_id, secret_access_key=secret)
        commitment = BucketCommitment(credentials=creds, **fields)
    except ValidationError as e:
        msgs = "; ".join(str(x["msg"]) for x in e.errors())
        raise CommitmentError(f"invalid commitment: {msgs}") from None
    if render_commitment(commitment) != body:
        raise CommitmentError("non-canonical commitment encoding")
    if not allow_private_endpoints and provider is Provider.LOCAL:
        raise CommitmentError("local (file://) buckets are refused outside local simulations")
    if not allow_private_endpoints and provider in _ENDPOINT:
        if provider is Provider.HTTP:
            raise CommitmentError("plain-http endpoints are refused outside local simulations")
        try:
            EndpointPolicy.production().check_host(*split_host(str(commitment.host)))
        except EndpointRefused as exc:
            raise CommitmentError(f"endpoint refused: {exc}") from None
    return commitment


def parse_commitment_fields(
    fields: Sequence[bytes], *, allow_private_endpoints: bool = False
) -> BucketCommitment:
    """`join_commitment_fields` then `parse_commitment`."""
    return parse_commitment(
        join_commitment_fields(fields), allow_private_endpoints=allow_private_endpoints
    )
