"""Vectorised variable-width bit fields (LSB-first), the storage layer of the index coder.

A field is an unsigned integer of 0..32 bits. `pack_fields` lays fields out back to back, least
significant bit first, in little-endian 32-bit words; `BitReader.read` takes many fields at once
given their widths. Both run as a handful of numpy passes with no Python loop per field.
"""

from __future__ import annotations

import numpy as np

from codec.errors import DecodeError

MAX_FIELD_BITS = 32
_U64 = np.uint64
_MASKS = (np.int64(1) << np.arange(MAX_FIELD_BITS + 1, dtype=np.int64)) - 1


def pack_fields(values: np.ndarray, widths: np.ndarray) -> tuple[bytes, int]:
    """Pack `values[i]` in `widths[i]` bits each; returns (bytes, total number of bits)."""
    widths = np.asarray(widths, dtype=np.int64)
    keep = widths > 0
    values = np.asarray(values).astype(_U64, copy=False)[keep]
    widths = widths[keep]
    total = int(widths.sum())
    if total == 0:
        return b"", 0
    pos = np.cumsum(widths) - widths
    word = pos >> 5
    off = (pos & 31).astype(_U64)
    low = (values << off) & _U64(0xFFFFFFFF)
    # Fields are back to back and at most 32 bits wide, so every word holds the start of some
    # field (but perhaps the last), and at most one field crosses into the next word. Disjoint
    # bit ranges: summing a word's low parts equals OR-ing them.
    words = np.zeros((total + 31) // 32 + 1, dtype=_U64)
    starts = np.flatnonzero(np.diff(word, prepend=-1))
    words[word[starts]] = np.add.reduceat(low, starts)
    cross = np.flatnonzero(off + widths.astype(_U64) > _U64(32))
    words[word[cross] + 1] |= values[cross] >> (_U64(32) - off[cross])
    return words.astype("<u4").tobytes()[: (total + 7) // 8], total


class BitReader:
    """Reads fields from a packed bit string; every read is bounds-checked against its length."""

    def __init__(self, data: bytes | memoryview, start_bit: int = 0) -> None:
        buf = np.frombuffer(bytes(data), dtype=np.uint8)
        self.total_bits = buf.size * 8
        padded = np.zeros(((buf.size + 3) // 4 + 2) * 4, dtype=np.uint8)
        padded[: buf.size] = buf
        words = padded.view("<u4").astype(_U64)
        # pairs[i] = words[i] | words[i+1] << 32: any field of <= 32 bits at bit offset < 32 of
        # word i lies inside pairs[i].
        # Stored as int64: a masked field of <= 32 bits at offset < 32 never reaches bit 63.
        self._pairs = (words[:-1] | (words[1:] << _U64(32))).view(np.int64)
        self.cursor = start_bit

    def read(self, widths: np.ndarray) -> np.ndarray:
        """Read consecutive fields of the given widths (each 0..32) from the cursor on."""
        widths = np.asarray(widths, dtype=np.int64)
        pos = self.cursor + np.cumsum(widths) - widths
        end = self.cursor + int(widths.sum())
        if end > self.total_bits:
            raise DecodeError(f"bit stream truncated: needs {end} bits, has {self.total_bits}")
        self.cursor = end
        return self.gather(pos, widths)

    def gather(self, pos: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """Fields (int64) at arbitrary bit positions (already bounds-checked by the caller)."""
        return (self._pairs[pos >> 5] >> (pos & 31)) & _MASKS[widths]

    def read_uniform(self, count: int, width: int) -> np.ndarray:
        """`count` fields of the same width."""
        return self.read(np.full(count, width, dtype=np.int64))

    def check_padding(self) -> None:
        """Everything after the cursor must be zero padding inside the last byte."""
        if self.total_bits - self.cursor >= 8:
            raise DecodeError(
                f"{(self.total_bits - self.cursor) // 8} trailing bytes after the index stream"
            )
        rest = self.total_bits - self.cursor
        if rest and int(self.gather(np.array([self.cursor]), np.array([rest]))[0]) != 0:
            raise DecodeError("non-zero padding bits after the index stream")
