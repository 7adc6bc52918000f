"""Fetched bodies held in memory, or spooled to local files as they arrive.

A validator fetches every registered peer's update of a window; holding them all would make its
memory grow with the number of peers. Given a spool file, `fetch_many` writes the body there as
it streams in (`Sink`) and returns a `Spooled`: the file's path, size and BLAKE2b-256 digest
(`protocol.signing.payload_hasher`, the digest a window's manifest pins bytes by). Whoever needs
the bytes later reads them back, one body at a time (`Spooled.read`); the read checks size and
digest, so a spool file that vanished or changed since is a `SpoolError`, never other bytes.
Peers fetch at most their gather size and keep bodies in memory (`InMemory`); both kinds of
`Body` answer the same `size`, `digest` and `read`.

The spool is local: no peer names a path (the caller names every file), files are created
exclusively and never through a link, a failed or cancelled transfer removes its partial file,
and a window's directory (`spool_directory`) is emptied before use and removed after.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from codec.errors import TesseraError
from protocol.signing import payload_hasher
from protocol.stores.atomic import write_all

__all__ = ["Body", "InMemory", "Sink", "SpoolError", "Spooled", "remove_spool", "spool_directory"]

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_READ = os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


class SpoolError(TesseraError, RuntimeError):
    """A spool file cannot be written, or read back as it was written (a local fault: it is
    never blamed on the peer whose body it holds)."""


@dataclass(frozen=True)
class InMemory:
    """A body held as its bytes."""

    data: bytes = field(repr=False)
    digest: str

    @classmethod
    def of(cls, data: bytes) -> InMemory:
        return cls(data, payload_hasher(data).hexdigest())

    @property
    def size(self) -> int:
        return len(self.data)

    def read(self) -> bytes:
        return self.data


@dataclass(frozen=True)
class Spooled:
    """A body in a local spool file: only its path, size and digest are held."""

    path: Path
    size: int
    digest: str

    def read(self) -> bytes:
        """The bytes as they were written; `SpoolError` if the file vanished or changed."""
        try:
            fd = os.open(self.path, _READ)
        except OSError as exc:
            raise SpoolError(f"spool file {self.path} is gone: {exc.strerror}") from None
        with open(fd, "rb", buffering=0) as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.size:
                raise SpoolError(
                    f"spool file {self.path} changed: {st.st_size} bytes, {self.size} written"
                )
            data = f.readall()
        if len(data) != self.size or payload_hasher(data).hexdigest() != self.digest:
            raise SpoolError(f"spool file {self.path} changed since it was written")
        return data


Body = InMemory | Spooled
"""A fetched body, wherever it is kept."""


class Sink:
    """One body as it arrives: into memory (`path` None) or into a new file at `path`.

    Use it as a context manager: leaving it by an exception (a cap, a timeout, a cancellation)
    removes the partial file. `finish` closes it and returns the `Body`."""

    def __init__(self, path: Path | None) -> None:
        self.size = 0
        self._path = path
        self._hash = payload_hasher()
        self._held = bytearray()
        self._fd: int | None = None
        if path is not None:
            try:
                self._fd = os.open(path, _CREATE, 0o600)
            except OSError as exc:
                raise SpoolError(f"cannot create spool file {path}: {exc.strerror}") from None

    def write(self, chunk: bytes) -> None:
        self._hash.update(chunk)
        self.size += len(chunk)
        if self._fd is None:
            self._held += chunk
            return
        try:
            write_all(self._fd, chunk)
        except OSError as exc:
            raise SpoolError(f"cannot write spool file {self._path}: {exc.strerror}") from None

    def finish(self) -> Body:
        digest = self._hash.hexdigest()
        if self._path is None:
            return InMemory(bytes(self._held), digest)
        self._close()
        return Spooled(self._path, self.size, digest)

    def abort(self) -> None:
        self._close()
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)

    def _close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> Sink:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abort()


@contextlib.contextmanager
def spool_directory(path: Path) -> Iterator[Path]:
    """An empty private directory at `path` (whatever was there, from a crash, removed first),
    removed with everything in it when the block ends."""
    remove_spool(path)
    path.mkdir(mode=0o700, parents=True)
    try:
        yield path
    finally:
        remove_spool(path)


def remove_spool(path: Path) -> None:
    """Remove a spool directory and everything in it (nothing there is not an error)."""
    try:
        shutil.rmtree(path)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise SpoolError(f"cannot remove spool directory {path}: {exc.strerror}") from None
