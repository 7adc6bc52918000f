"""Strict readers for the SCALE-decoded values substrate-interface hands back from subtensor.

The node is not trusted and the decoded shapes differ between client libraries and runtime
versions (an account may come back as an SS58 string, hex, bytes or a tuple of ints; a bounded
vector may or may not be wrapped in a one-element list). Each reader accepts the known shapes,
checks types and bounds, and raises `ValueError` for anything else.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from protocol.chain.models import (
    MAX_BLOCK,
    MAX_COMMITMENT_BYTES,
    MAX_UID,
    canonical_hotkey,
    hotkey_from_public_key,
)

MAX_LIST = MAX_UID + 1
_RAW_VARIANT = re.compile(r"^Raw(\d{1,3})?$")
_HEX = re.compile(r"^0x([0-9a-fA-F]{2})*$")


def unwrap(value: object) -> object:
    """The plain value of a `ScaleType` (its `.value`), or the value itself."""
    if hasattr(value, "value") and not isinstance(value, bytes | str | int | list | tuple | dict):
        return value.value
    return value


def decode_int(value: object, *, lo: int = 0, hi: int = 2**64 - 1, what: str = "integer") -> int:
    """An integer in [lo, hi]; one-field newtype wrappers (`{"x": n}`, `(n,)`) are unwrapped."""
    value = unwrap(value)
    for _ in range(2):
        if isinstance(value, dict) and len(value) == 1:
            value = next(iter(value.values()))
        elif isinstance(value, list | tuple) and len(value) == 1:
            value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} is not an integer: {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} {value} out of range [{lo}, {hi}]")
    return value


def decode_bytes(value: object, *, max_len: int) -> bytes:
    """Bytes given as hex (`0x..`), bytes, or a (possibly nested) sequence of ints 0..255."""
    value = unwrap(value)
    if isinstance(value, str):
        if len(value) > 2 + 2 * max_len or not _HEX.match(value):
            raise ValueError("not a bounded 0x-hex string")
        out = bytes.fromhex(value[2:])
    elif isinstance(value, bytes | bytearray):
        out = bytes(value)
    elif isinstance(value, list | tuple):
        if len(value) == 1 and isinstance(value[0], list | tuple):
            value = value[0]
        if len(value) > max_len or not all(
            isinstance(b, int) and not isinstance(b, bool) and 0 <= b <= 255 for b in value
        ):
            raise ValueError("not a bounded sequence of bytes")
        out = bytes(value)
    else:
        raise ValueError(f"cannot read bytes from {type(value).__name__}")
    if len(out) > max_len:
        raise ValueError(f"{len(out)} bytes exceed the bound of {max_len}")
    return out


def decode_account(value: object) -> str:
    """An account id as a canonical SS58 (format 42) address."""
    value = unwrap(value)
    if isinstance(value, str) and not value.startswith("0x"):
        return canonical_hotkey(value)
    return hotkey_from_public_key(decode_bytes(value, max_len=32))


def decode_bool_list(value: object, *, max_len: int = MAX_LIST) -> list[bool]:
    value = unwrap(value)
    if not isinstance(value, list | tuple) or len(value) > max_len:
        raise ValueError("not a bounded list")
    if not all(isinstance(v, bool) for v in value):
        raise ValueError("list holds non-booleans")
    return list(value)


def decode_int_list(value: object, *, hi: int, what: str, max_len: int = MAX_LIST) -> list[int]:
    """A bounded `Vec` of integers in [0, hi] (e.g. `LastUpdate`, a `Vec<u64>` of blocks)."""
    value = unwrap(value)
    if not isinstance(value, list | tuple) or len(value) > max_len:
        raise ValueError(f"{what} is not a bounded list")
    return [decode_int(v, hi=hi, what=what) for v in value]


def decode_weight_pairs(value: object) -> list[tuple[int, int]]:
    """`Vec<(u16, u16)>` as (uid, raw weight) pairs."""
    value = unwrap(value)
    if not isinstance(value, list | tuple) or len(value) > MAX_LIST:
        raise ValueError("weights are not a bounded list")
    pairs: list[tuple[int, int]] = []
    for item in value:
        if isinstance(item, dict) and len(item) == 2:
            item = tuple(item.values())
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise ValueError("weight entry is not a (uid, weight) pair")
        pairs.append(
            (
                decode_int(item[0], hi=MAX_UID, what="uid"),
                decode_int(item[1], hi=65_535, what="weight"),
            )
        )
    return pairs


def _fields(info: object) -> Sequence[object]:
    if not isinstance(info, dict) or "fields" not in info:
        raise ValueError("commitment info has no fields")
    fields = info["fields"]
    if (
        isinstance(fields, list | tuple)
        and len(fields) == 1
        and isinstance(fields[0], list | tuple)
    ):
        fields = fields[0]  # a BoundedVec decoded as a one-element tuple around the Vec
    if not isinstance(fields, list | tuple) or len(fields) > 16:
        raise ValueError("commitment fields are not a short list")
    return fields


def decode_raw_field(field: object) -> bytes:
    """The bytes of one `Data::Raw<N>` field (`{"Raw5": "0x..."}`); `ValueError` otherwise."""
    if not isinstance(field, dict) or len(field) != 1:
        raise ValueError("a commitment field is a one-key mapping")
    ((name, payload),) = field.items()
    match = _RAW_VARIANT.match(str(name))
    if match is None:
        raise ValueError(f"unsupported commitment field type {str(name)[:32]!r}")
    data = decode_bytes(payload, max_len=MAX_COMMITMENT_BYTES)
    if match.group(1) is not None and int(match.group(1)) != len(data):
        raise ValueError(f"{name} field holds {len(data)} bytes")
    return data


def decode_registration(value: object) -> tuple[bytes, int]:
    """`Commitments.CommitmentOf` (`Registration {deposit, block, info}`) as (data, block).

    The data is the first raw field; other field types (hashes, timelocked blobs) are ignored.
    """
    value = unwrap(value)
    if not isinstance(value, dict):
        raise ValueError("commitment registration is not a mapping")
    block = decode_int(value.get("block"), hi=MAX_BLOCK, what="commitment block")
    for field in _fields(value.get("info")):
        try:
            return decode_raw_field(field), block
        except ValueError:
            continue
    raise ValueError("commitment holds no raw field")
