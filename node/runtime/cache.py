"""The node's local cache directory and a "build once, then reuse" helper.

The cache root is `$TESSERA_CACHE` when set, else `~/.cache/tessera`. Entries are immutable files
or directories whose names carry a digest of everything they were built from, so an entry is
never stale: a different input gives a different name. Entries are written atomically, and a
per-entry lock file keeps several local processes (a simulation's peers) from building the same
entry at once; whoever comes second finds it built.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

__all__ = ["CACHE_ENV", "build_once", "cache_root", "entry_lock"]

CACHE_ENV = "TESSERA_CACHE"
_DEFAULT = Path("~/.cache/tessera")

T = TypeVar("T")


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The cache root: `cache_dir` if given, else `$TESSERA_CACHE`, else `~/.cache/tessera`."""
    if cache_dir is not None:
        root = Path(cache_dir)
    else:
        env = os.environ.get(CACHE_ENV)
        root = Path(env) if env else _DEFAULT
    return root.expanduser().absolute()


@contextlib.contextmanager
def entry_lock(entry: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock for building `entry` (a `.lock` file beside it)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    lock_path = entry.parent / f"{entry.name}.lock"
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def build_once(entry: Path, build: Callable[[Path], None]) -> Path:
    """Return `entry`, calling `build(entry)` first if it does not exist yet.

    `build` must create `entry` atomically (e.g. with `node.runtime.atomic_files`). Concurrent callers
    in other processes wait for the first builder instead of repeating its work.
    """
    if entry.exists():
        return entry
    with entry_lock(entry):
        if not entry.exists():
            build(entry)
    if not entry.exists():
        raise RuntimeError(f"cache builder did not create {entry}")
    return entry
