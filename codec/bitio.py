"""Vectorised variable-width bit fields (LSB-first), the storage layer of the index coder.

A field is an unsigned integer of 0..32 bits. `pack_fields` lays fields out back to back, least
significant bit first, in little-endian 32-bit words; `BitReader.read` takes many fields at once
given their widths; `join_bits` appends one packed bit string to another at any bit offset. All
run as a handful of numpy passes with no Python loop per field.
"""

from __future__ import annotations

import sys

import numpy as np

from codec.errors import DecodeError

MAX_FIELD_BITS = 32
_U64 = np.uint64
_MASKS = (np.int64(1) << np.arange(MAX_FIELD_BITS + 1, dtype=np.int64)) - 1


def pack_fields(values: np.ndarray, widths: np.ndarray) -> tuple[bytes, int]:
    """Pack `values[i]` (< 2**widths[i]) in `widths[i]` bits each; returns (bytes, total bits)."""
    widths = np.asarray(widths, dtype=np.int64)
    ends = np.cumsum(widths)
    total = int(ends[-1]) if ends.size else 0
    if total == 0:
        return b"", 0
    pos = ends - widths
    word = pos >> 5
    shift = (pos & 31).view(_U64)
    shifted = np.asarray(values).astype(np.int64, copy=False).view(_U64) << shift  # < 2**64
    halves = shifted.view(np.uint32).reshape(-1, 2)  # each field's (low, high) 32-bit parts
    if sys.byteorder == "big":
        halves = halves[:, ::-1]
    # Fields are disjoint, so summing the parts that land in a word equals OR-ing them, and each
    # word's sum stays below 2**32: exact in the float64 weights of a bincount.
    n_words = (total + 31) // 32 + 1
    low = np.bincount(word, weights=halves[:, 0], minlength=n_words)
    high = np.bincount(word, weights=halves[:, 1], minlength=n_words)
    words = low.astype("<u4")
    words[1:] |= high[:-1].astype("<u4")
    return words.tobytes()[: (total + 7) // 8], total


def join_bits(head: bytes, head_bits: int, tail: bytes, tail_bits: int) -> bytes:
    """The first `head_bits` bits of `head` followed by the first `tail_bits` bits of `tail`."""
    total = head_bits + tail_bits
    n_words = (total + 31) // 32 + 2
    out = np.zeros(n_words, dtype=_U64)
    hw = _words(head, head_bits)
    out[: hw.size] = hw
    tw = _words(tail, tail_bits) << _U64(head_bits & 31)
    at = head_bits >> 5
    out[at : at + tw.size] |= tw & _U64(0xFFFFFFFF)
    out[at + 1 : at + 1 + tw.size] |= tw >> _U64(32)
    return out.astype("<u4").tobytes()[: (total + 7) // 8]


def _words(data: bytes, bits: int) -> np.ndarray:
    """The first `bits` bits of `data` as little-endian 32-bit words (uint64), the rest zero."""
    n_bytes = (bits + 7) // 8
    buf = np.zeros((n_bytes + 3) // 4 * 4, dtype=np.uint8)
    buf[:n_bytes] = np.frombuffer(data, dtype=np.uint8, count=n_bytes)
    if bits % 8:
        buf[n_bytes - 1] &= (1 << (bits % 8)) - 1
    return buf.view("<u4").astype(_U64)


class BitReader:
    """Reads fields from a packed bit string; every read is bounds-checked against its length."""

    def __init__(self, data: bytes | memoryview, start_bit: int = 0) -> None:
        buf = np.frombuffer(bytes(data), dtype=np.uint8)
        self.total_bits = buf.size * 8
        padded = np.zeros(((buf.size + 3) // 4 + 2) * 4, dtype=np.uint8)
        padded[: buf.size] = buf
        # pairs[i] = words[i] | words[i+1] << 32 (32-bit little-endian words): any field of <= 32
        # bits at bit offset < 32 of word i lies inside pairs[i]. It is the 64-bit little-endian
        # value at byte 4 * i: the even ones and the odd ones are two views of the bytes.
        # Stored as int64: a masked field of <= 32 bits at offset < 32 never reaches bit 63.
        n_pairs = padded.size // 4 - 1
        self.pairs = np.empty(n_pairs, dtype=np.int64)
        self.pairs[0::2] = padded[: 8 * ((n_pairs + 1) // 2)].view("<i8")
        self.pairs[1::2] = padded[4 : 4 + 8 * (n_pairs // 2)].view("<i8")
        self.cursor = start_bit

    def read(self, widths: np.ndarray) -> np.ndarray:
        """Read consecutive fields of the given widths (each 0..32) from the cursor on."""
        widths = np.asarray(widths, dtype=np.int64)
        pos = np.cumsum(widths)
        end = self.cursor + (int(pos[-1]) if pos.size else 0)
        if end > self.total_bits:
            raise DecodeError(f"bit stream truncated: needs {end} bits, has {self.total_bits}")
        pos -= widths
        pos += self.cursor
        self.cursor = end
        return self.gather(pos, widths)

    def gather(self, pos: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """Fields (int64) at arbitrary bit positions (already bounds-checked by the caller)."""
        out = self.pairs.take(pos >> 5)
        out >>= pos & 31
        out &= _MASKS.take(widths)
        return out

    def shift_in(self, x: np.ndarray, bits: np.ndarray) -> None:
        """x[i] = x[i] << w | (the next field of w = bits[i + 1] bits), fields read in order from
        the cursor on. `bits` (x.size + 1, overwritten) is scratch with the widths after its first
        item, so that one running sum over it gives every field's position."""
        widths = bits[1:]
        x <<= widths
        masks = np.left_shift(1, widths)
        masks -= 1
        bits[0] = self.cursor
        pos = np.cumsum(bits, out=bits)
        end = int(pos[-1])
        if end > self.total_bits:
            raise DecodeError(f"bit stream truncated: needs {end} bits, has {self.total_bits}")
        self.cursor = end
        pos = pos[:-1]
        field = self.pairs.take(pos >> 5)
        pos &= 31
        field >>= pos
        field &= masks
        x |= field

    def read_uniform(self, count: int, width: int) -> np.ndarray:
        """`count` fields of the same width (their positions need no running sum)."""
        end = self.cursor + count * width
        if end > self.total_bits:
            raise DecodeError(f"bit stream truncated: needs {end} bits, has {self.total_bits}")
        pos = self.cursor + np.arange(count, dtype=np.int64) * width
        self.cursor = end
        out = self.pairs.take(pos >> 5)
        out >>= pos & 31
        out &= (1 << width) - 1
        return out

    def check_padding(self) -> None:
        """Everything after the cursor must be zero padding inside the last byte."""
        if self.total_bits - self.cursor >= 8:
            raise DecodeError(
                f"{(self.total_bits - self.cursor) // 8} trailing bytes after the index stream"
            )
        rest = self.total_bits - self.cursor
        if rest and int(self.gather(np.array([self.cursor]), np.array([rest]))[0]) != 0:
            raise DecodeError("non-zero padding bits after the index stream")
