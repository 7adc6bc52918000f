"""Atomic local file writes for the node: a reader sees the old file or the complete new one.

Everything the node keeps on disk (cache entries, exported weights, shards, indexes) goes through
here: write to a temporary file in the target's directory, fsync, `os.replace` onto the target,
fsync the directory. On failure the temporary file is removed and the target is left untouched.
The temporary names come from `protocol.stores.atomic.temp_name`, so they can never collide with
a store key or a shard name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from protocol.stores.atomic import atomic_write, fsync_dir, temp_name, write_all
from protocol.stores.keys import TEMP_PREFIX

__all__ = [
    "atomic_dir",
    "atomic_path",
    "remove_stale_temporaries",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]


def write_bytes_atomic(dest: str | os.PathLike[str], data: bytes | bytearray | memoryview) -> Path:
    """Write `data` to `dest` atomically (creating parent directories); returns the path."""
    target = Path(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    with atomic_write(target) as fd:
        write_all(fd, data)
    return target


def write_text_atomic(dest: str | os.PathLike[str], text: str) -> Path:
    """Write UTF-8 `text` to `dest` atomically."""
    return write_bytes_atomic(dest, text.encode("utf-8"))


def write_json_atomic(dest: str | os.PathLike[str], obj: Any) -> Path:
    """Write `obj` as pretty, key-sorted JSON (plus a newline) to `dest` atomically."""
    text = json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"
    return write_text_atomic(dest, text)


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; on clean exit fsync it and rename it onto `dest`.

    For writers that insist on a path of their own (safetensors, `numpy.save`).
    """
    target = Path(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_name()
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    fsync_dir(target.parent)


@contextlib.contextmanager
def atomic_dir(dest: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a fresh temporary directory next to `dest`; on clean exit rename it onto `dest`.

    If `dest` appeared meanwhile (another process built the same thing), the existing directory
    wins and ours is discarded, so concurrent builders of identical content never conflict.
    """
    target = Path(dest)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / temp_name()
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():
                raise
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale_temporaries(directory: Path) -> list[Path]:
    """Remove what interrupted atomic writes left in `directory` itself (files and folders named
    by `temp_name`, e.g. a full-size state file a kill cut short); returns what it removed. Call
    at start-up, before the node writes anything there."""
    if not directory.is_dir():
        return []
    stale = sorted(p for p in directory.iterdir() if p.name.startswith(TEMP_PREFIX))
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale
