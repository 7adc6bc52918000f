"""Unsigned LEB128 varints with a hard length limit."""

from __future__ import annotations

from codec.errors import DecodeError

MAX_VARINT_BYTES = 10


def write_varint(out: bytearray, value: int) -> None:
    if value < 0:
        raise ValueError("varints are unsigned")
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    """Read a varint at `pos`; returns (value, next position)."""
    value = 0
    for i in range(MAX_VARINT_BYTES):
        if pos + i >= len(data):
            raise DecodeError("truncated varint")
        byte = data[pos + i]
        value |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if i and byte == 0:
                raise DecodeError("non-canonical varint")
            return value, pos + i + 1
    raise DecodeError("varint too long")
