"""Rules for object keys, list prefixes and bucket names, shared by every backend.

A key is one or more segments joined by "/". Each segment uses only `A-Z a-z 0-9 - _ . = + , @ ~ :`,
is at most 255 bytes (a file name on Linux), is not "." or "..", and does not start with the
reserved temporary-file prefix. The whole key is at most 1024 bytes (the S3 limit), has no leading
or trailing "/" and no empty segment. The same rules hold for file:// and s3:// so that a key that
works on one backend works on the other, and so that a key can never escape a file:// bucket
directory.
"""

from __future__ import annotations

import re

from protocol.stores.errors import InvalidKey

__all__ = [
    "MAX_KEY_BYTES",
    "MAX_SEGMENT_BYTES",
    "TEMP_PREFIX",
    "validate_bucket_name",
    "validate_key",
    "validate_prefix",
]

MAX_KEY_BYTES = 1024
MAX_SEGMENT_BYTES = 255
TEMP_PREFIX = ".tessera-tmp-"
"""Temporary files of atomic writes start with this; no key segment may."""

_SEGMENT_CHARS = re.compile(r"[A-Za-z0-9\-_.=+,@~:]+")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]")


def _check_segment(segment: str, whole: str) -> None:
    if not segment:
        raise InvalidKey(f"key {whole!r} has an empty segment (leading, trailing or double '/')")
    if segment in (".", ".."):
        raise InvalidKey(f"key {whole!r} has a {segment!r} segment")
    if len(segment) > MAX_SEGMENT_BYTES:
        raise InvalidKey(f"key {whole[:64]!r}… has a segment longer than {MAX_SEGMENT_BYTES}")
    if segment.startswith(TEMP_PREFIX):
        raise InvalidKey(f"key {whole!r} uses the reserved prefix {TEMP_PREFIX!r}")
    if _SEGMENT_CHARS.fullmatch(segment) is None:
        raise InvalidKey(f"key {whole[:64]!r} has a character outside [A-Za-z0-9-_.=+,@~:/]")


def validate_key(key: object) -> str:
    """Return `key` unchanged if it follows the key rules, else raise `InvalidKey`."""
    if not isinstance(key, str):
        raise InvalidKey(f"key must be a str, not {type(key).__name__}")
    if not key:
        raise InvalidKey("key is empty")
    if len(key) > MAX_KEY_BYTES:  # all allowed characters are ASCII: chars == bytes
        raise InvalidKey(f"key is longer than {MAX_KEY_BYTES} bytes")
    for segment in key.split("/"):
        _check_segment(segment, key)
    return key


def validate_prefix(prefix: object) -> str:
    """Return a list prefix if valid: "" or complete segments ending in "/" plus a partial tail.

    The complete segments (before the last "/") follow the key rules; the tail after the last
    "/" may be any run of allowed characters (a prefix like "gradient-12-" or "a/." is fine).
    """
    if not isinstance(prefix, str):
        raise InvalidKey(f"prefix must be a str, not {type(prefix).__name__}")
    if len(prefix) > MAX_KEY_BYTES:
        raise InvalidKey(f"prefix is longer than {MAX_KEY_BYTES} bytes")
    head, _, tail = prefix.rpartition("/")
    if head or prefix.startswith("/"):
        for segment in head.split("/"):
            _check_segment(segment, prefix)
    if tail and _SEGMENT_CHARS.fullmatch(tail) is None:
        raise InvalidKey(f"prefix {prefix[:64]!r} has a character outside [A-Za-z0-9-_.=+,@~:/]")
    return prefix


def validate_bucket_name(bucket: object) -> str:
    """S3 bucket naming rules (3-63 chars of a-z 0-9 . -, alphanumeric at both ends, no '..')."""
    if not isinstance(bucket, str) or _BUCKET.fullmatch(bucket) is None or ".." in bucket:
        shown = repr(bucket)[:80]
        raise InvalidKey(f"bucket name {shown} is not valid (3-63 chars of a-z 0-9 . -)")
    return bucket
