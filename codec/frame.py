"""The frame every update container shares: ``MAGIC | version (u8) | header length (u32 LE) |
header (msgpack) | payload``, and what is signed: BLAKE2b-256 of the framed header.

A container (`codec.wire` for sparse updates, `codec.dense` for dense ones) has its own magic,
version and header model; this module only frames, splits and parses, with every size checked
before anything is allocated and the msgpack parse bounded. Whatever is wrong is a `DecodeError`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import msgpack

from codec.errors import DecodeError

MAX_HEADER_BYTES = 4 << 20
_PREFIX = struct.Struct("<4sBI")


def payload_digest(payload: bytes | memoryview) -> bytes:
    """BLAKE2b-256 of a payload (what a header's ``digest`` field holds)."""
    return hashlib.blake2b(payload, digest_size=32).digest()


@dataclass(frozen=True)
class Frame:
    """One container kind: its magic and format version."""

    magic: bytes
    version: int
    name: str  # "Tessera update", "Tessera dense update": for error messages

    def pack(self, header: bytes, payload: bytes | memoryview = b"") -> bytes:
        """The framed object: prefix, header bytes, payload."""
        return _PREFIX.pack(self.magic, self.version, len(header)) + header + bytes(payload)

    def digest(self, header: bytes) -> bytes:
        """What a signature covers: BLAKE2b-256 of the framed header (no payload)."""
        return payload_digest(self.pack(header))

    def split(self, data: bytes | memoryview, max_bytes: int) -> tuple[memoryview, memoryview]:
        """(header bytes, payload) of a framed object, after checking size, magic and version."""
        view = memoryview(data)
        if len(view) > max_bytes:
            raise DecodeError(f"update of {len(view)} bytes exceeds the limit of {max_bytes}")
        if len(view) < _PREFIX.size:
            raise DecodeError("update truncated before its header")
        magic, version, header_len = _PREFIX.unpack_from(view)
        if magic != self.magic:
            raise DecodeError(f"not a {self.name} (bad magic)")
        if version != self.version:
            raise DecodeError(f"unsupported {self.name} format version {version}")
        if header_len > min(MAX_HEADER_BYTES, len(view) - _PREFIX.size):
            raise DecodeError(f"header length {header_len} is impossible for this object")
        end = _PREFIX.size + header_len
        return view[_PREFIX.size : end], view[end:]


def unpack_header(raw: memoryview | bytes, max_array_len: int = 1 << 16) -> dict[str, Any]:
    """A header's msgpack map, parsed with tight limits (tuples for arrays, str keys only).

    Raises ValueError/TypeError/msgpack errors for the caller to turn into its `DecodeError`."""
    obj = msgpack.unpackb(
        raw,
        raw=False,
        use_list=False,
        strict_map_key=True,
        max_str_len=1024,
        max_bin_len=256,
        max_array_len=max_array_len,
        max_map_len=64,
        max_ext_len=0,
    )
    if not isinstance(obj, dict):
        raise ValueError("header is not a map")
    return obj


def pack_header(obj: dict[str, Any]) -> bytes:
    """The canonical msgpack bytes of a header map (`unpack_header`'s inverse)."""
    return msgpack.packb(obj, use_bin_type=True)
