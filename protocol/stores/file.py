"""The embedded object store: one directory per bucket on the local file system.

Layout: the object `a/b/c.bin` of bucket directory `D` is the file `D/a/b/c.bin`. Writes go to a
temporary file in the same directory (`.tessera-tmp-…`, never a valid key), are fsynced and then
renamed over the target with `os.replace`, so any number of processes may read and write the same
keys at once and a reader always sees a complete object. `last_modified` is the file's mtime in
UTC. The bucket directory is created on the first write.

Unlike S3, a key cannot be both an object and a "directory" prefix of another key (`a` and
`a/b`); such a write raises `StoreError`.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

from protocol.stores.atomic import atomic_write, write_all
from protocol.stores.base import DEFAULT_LIST_LIMIT, ObjectInfo, ObjectStore, check_max_bytes
from protocol.stores.errors import (
    ListingTooLarge,
    ObjectExists,
    ObjectNotFound,
    ObjectTooLarge,
    ReadOnlyStoreError,
    StoreError,
)
from protocol.stores.keys import TEMP_PREFIX, validate_key, validate_prefix

__all__ = ["FileStore"]

_CHUNK = 1 << 20
_RDONLY = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


class FileStore(ObjectStore):
    """An `ObjectStore` backed by the directory `bucket_dir`."""

    def __init__(
        self, bucket_dir: str | os.PathLike[str], *, read_only: bool = False, fsync: bool = True
    ) -> None:
        path = Path(bucket_dir)
        if not path.is_absolute():
            raise StoreError(f"file store directory must be absolute, got {str(path)!r}")
        self._dir = path
        self._read_only = read_only
        self._fsync = fsync

    @property
    def directory(self) -> Path:
        return self._dir

    @property
    def location(self) -> str:
        return f"file://{self._dir}"

    @property
    def read_only(self) -> bool:
        return self._read_only

    # -- helpers -------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        return self._dir.joinpath(*validate_key(key).split("/"))

    def _require_writable(self, op: str) -> None:
        if self._read_only:
            raise ReadOnlyStoreError(f"{op} refused: {self.location} was opened read-only")

    @contextlib.contextmanager
    def _open_object(self, key: str) -> Iterator[tuple[int, os.stat_result]]:
        path = self._path(key)
        try:
            fd = os.open(path, _RDONLY)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key, self.location) from None
        except OSError as exc:
            raise StoreError(f"cannot open {key!r} in {self.location}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ObjectNotFound(key, self.location)
            yield fd, st
        finally:
            os.close(fd)

    def _copy_exact(self, key: str, src: int, size: int, sink: int | memoryview) -> None:
        """Copy exactly `size` bytes of `src` to a fd or into a buffer; detect in-place changes."""
        scratch = bytearray(min(_CHUNK, max(size, 1)))
        done = 0
        while done < size:
            want = min(len(scratch), size - done)
            if isinstance(sink, memoryview):
                got = os.readv(src, [sink[done : done + want]])
            else:
                got = os.readv(src, [memoryview(scratch)[:want]])
                write_all(sink, memoryview(scratch)[:got])
            if got == 0:
                raise StoreError(f"object {key!r} shrank while it was read")
            done += got
        if os.read(src, 1):
            raise StoreError(f"object {key!r} grew while it was read (written in place?)")

    def _prepare_parent(self, key: str, path: Path) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(
                f"cannot store {key!r} in {self.location}: a parent of it is an object"
            ) from None

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: str, max_bytes: int) -> bytes:
        check_max_bytes(max_bytes)
        with self._open_object(key) as (fd, st):
            if st.st_size > max_bytes:
                raise ObjectTooLarge(key, max_bytes, st.st_size)
            buf = bytearray(st.st_size)
            self._copy_exact(key, fd, st.st_size, memoryview(buf))
        return bytes(buf)

    def get_to_file(self, key: str, path: str | os.PathLike[str], max_bytes: int) -> int:
        check_max_bytes(max_bytes)
        with self._open_object(key) as (fd, st):
            if st.st_size > max_bytes:
                raise ObjectTooLarge(key, max_bytes, st.st_size)
            try:
                with atomic_write(path, fsync=self._fsync) as out:
                    self._copy_exact(key, fd, st.st_size, out)
            except OSError as exc:
                raise StoreError(f"cannot write {os.fspath(path)!r}: {exc.strerror}") from exc
            return st.st_size

    def head(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            raise ObjectNotFound(key, self.location) from None
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFound(key, self.location)
        return ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, tz=UTC))

    def list(self, prefix: str = "", *, limit: int = DEFAULT_LIST_LIMIT) -> list[ObjectInfo]:
        validate_prefix(prefix)
        base, _, tail = prefix.rpartition("/")
        start = self._dir.joinpath(*base.split("/")) if base else self._dir
        found: list[ObjectInfo] = []
        for root, dirs, files in os.walk(start, followlinks=False):
            if root == str(start):
                dirs[:] = [d for d in dirs if d.startswith(tail)]
            dirs[:] = [d for d in dirs if not d.startswith(TEMP_PREFIX)]
            rel_root = os.path.relpath(root, self._dir)
            for name in files:
                if name.startswith(TEMP_PREFIX):
                    continue
                key = name if rel_root == "." else f"{rel_root.replace(os.sep, '/')}/{name}"
                if not key.startswith(prefix):
                    continue
                try:
                    validate_key(key)
                    st = os.lstat(os.path.join(root, name))
                except (StoreError, OSError):
                    continue  # foreign file name, or removed since the walk saw it
                if not stat.S_ISREG(st.st_mode):
                    continue
                found.append(
                    ObjectInfo(key, st.st_size, datetime.fromtimestamp(st.st_mtime, tz=UTC))
                )
                if len(found) > limit:
                    raise ListingTooLarge(
                        f"{self.location} has more than {limit} objects under {prefix!r}"
                    )
        found.sort(key=lambda info: info.key)
        return found

    # -- writes --------------------------------------------------------------------------------

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._require_writable("put")
        path = self._path(key)
        self._prepare_parent(key, path)
        try:
            with atomic_write(path, fsync=self._fsync) as fd:
                write_all(fd, data)
        except IsADirectoryError:
            raise StoreError(f"cannot store {key!r}: other objects live under it") from None
        except OSError as exc:
            raise StoreError(f"cannot store {key!r} in {self.location}: {exc.strerror}") from exc

    def put_new(self, key: str, data: bytes | bytearray | memoryview) -> None:
        self._require_writable("put")
        path = self._path(key)
        self._prepare_parent(key, path)
        try:
            with atomic_write(path, fsync=self._fsync, replace=False) as fd:
                write_all(fd, data)
        except FileExistsError:
            raise ObjectExists(key, self.location) from None
        except IsADirectoryError:
            raise StoreError(f"cannot store {key!r}: other objects live under it") from None
        except OSError as exc:
            raise StoreError(f"cannot store {key!r} in {self.location}: {exc.strerror}") from exc

    def put_file(self, key: str, path: str | os.PathLike[str]) -> int:
        self._require_writable("put_file")
        target = self._path(key)
        self._prepare_parent(key, target)
        try:
            src = os.open(path, _RDONLY)
        except OSError as exc:
            raise StoreError(f"cannot read {os.fspath(path)!r}: {exc.strerror}") from exc
        try:
            size = os.fstat(src).st_size
            with atomic_write(target, fsync=self._fsync) as fd:
                self._copy_exact(key, src, size, fd)
        except IsADirectoryError:
            raise StoreError(f"cannot store {key!r}: other objects live under it") from None
        except OSError as exc:
            raise StoreError(f"cannot store {key!r} in {self.location}: {exc.strerror}") from exc
        finally:
            os.close(src)
        return size

    def delete(self, key: str) -> None:
        self._require_writable("delete")
        path = self._path(key)
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return
        except OSError as exc:
            raise StoreError(f"cannot delete {key!r} in {self.location}: {exc.strerror}") from exc
