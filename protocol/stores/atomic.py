"""Atomic file creation: write a temporary file next to the target, fsync, then rename.

Readers of `dest` see either the previous file or the complete new one. On any failure (an
exception inside the block, a failed fsync or rename) the temporary file is removed and `dest` is
left untouched.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

from protocol.stores.keys import TEMP_PREFIX

__all__ = ["atomic_write", "fsync_dir", "temp_name", "write_all"]

_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


def temp_name() -> str:
    """A fresh temporary file name (never a valid key segment, see `keys.TEMP_PREFIX`)."""
    return f"{TEMP_PREFIX}{secrets.token_hex(12)}"


def fsync_dir(directory: Path) -> None:
    """Persist a rename in `directory` (best effort where directories cannot be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_write(
    dest: str | os.PathLike[str], *, fsync: bool = True, replace: bool = True
) -> Iterator[int]:
    """Yield a file descriptor of a new temporary file; rename it onto `dest` on clean exit.
    With ``replace=False`` it is linked to `dest` only if nothing is there (`FileExistsError`
    otherwise, `dest` untouched)."""
    target = Path(dest)
    tmp = target.parent / temp_name()
    fd = os.open(tmp, _FLAGS, 0o666)
    committed = False
    try:
        try:
            yield fd
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, target)
        else:
            os.link(tmp, target)  # atomic, and refused if `target` exists
            os.unlink(tmp)
        committed = True
    finally:
        if not committed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    if fsync:
        fsync_dir(target.parent)


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    """os.write until every byte is written."""
    view = memoryview(data).cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]
