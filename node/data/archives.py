"""Read selected text files out of a tar or zip archive, in memory, with bounds.

Nothing is ever written to disk by a member's name, and archives are treated as hostile:

- only regular files are read; symbolic and hard links, devices and folders are skipped;
- a name that is absolute or climbs with ``..`` is skipped (counted as unsafe);
- a member larger than `max_member_bytes` is skipped: no more than that many bytes (plus one)
  are ever read from a member, whatever its header claims;
- more than `max_total_bytes` of selected bytes in one archive is refused (`DataError`).

Tar archives (plain or compressed) are streamed once front to back; zip archives (wheels too)
are read through their central directory. Members come back sorted by name.
"""

from __future__ import annotations

import stat
import tarfile
import zipfile
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath
from typing import IO

from node.data.shards import DataError

__all__ = ["ArchiveStats", "Member", "read_members"]


@dataclass(frozen=True)
class Member:
    name: str
    data: bytes


@dataclass
class ArchiveStats:
    """What `read_members` took and skipped from one archive."""

    members: int = 0
    bytes: int = 0
    too_large: list[str] = field(default_factory=list)
    unsafe: list[str] = field(default_factory=list)


def _unsafe_name(name: str) -> bool:
    path = PurePosixPath(name)
    return not name or "\\" in name or path.is_absolute() or ".." in path.parts


class _Selector:
    def __init__(
        self,
        include: tuple[str, ...],
        exclude: tuple[str, ...],
        max_member_bytes: int,
        max_total_bytes: int,
    ) -> None:
        self.include, self.exclude = include, exclude
        self.max_member, self.max_total = max_member_bytes, max_total_bytes
        self.stats = ArchiveStats()
        self.members: list[Member] = []

    def wanted(self, name: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.include) and not any(
            fnmatchcase(name, p) for p in self.exclude
        )

    def take(self, name: str, stream: IO[bytes] | None) -> None:
        """Keep member `name` read from `stream` (None: not a regular file) if it is safe."""
        if stream is None or _unsafe_name(name):
            self.stats.unsafe.append(name)
            return
        data = stream.read(self.max_member + 1)  # whatever the header claims
        if len(data) > self.max_member:
            self.stats.too_large.append(name)
            return
        self.stats.bytes += len(data)
        if self.stats.bytes > self.max_total:
            raise DataError(
                f"more than {self.max_total:,} bytes of selected files in one archive: raise "
                "max_archive_text_bytes in the recipe or narrow its include patterns"
            )
        self.stats.members += 1
        self.members.append(Member(name, data))


def _read_tar(path: Path, sel: _Selector) -> None:
    with tarfile.open(path, mode="r|*") as tar:
        for info in tar:
            if info.isdir() or not sel.wanted(info.name):
                continue
            sel.take(info.name, tar.extractfile(info) if info.isreg() else None)


def _zip_is_regular(info: zipfile.ZipInfo) -> bool:
    kind = stat.S_IFMT(info.external_attr >> 16)  # 0 when the writer recorded permissions only
    return not info.is_dir() and kind in (0, stat.S_IFREG)


def _read_zip(path: Path, sel: _Selector) -> None:
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.is_dir() or not sel.wanted(info.filename):
                continue
            if not _zip_is_regular(info):
                sel.take(info.filename, None)
                continue
            with archive.open(info) as stream:
                sel.take(info.filename, stream)


def read_members(
    path: Path,
    *,
    include: tuple[str, ...],
    exclude: tuple[str, ...] = (),
    max_member_bytes: int,
    max_total_bytes: int,
) -> tuple[list[Member], ArchiveStats]:
    """The members of `path` that `include` and not `exclude` select (`fnmatch` patterns, ``*``
    matching ``/`` too), sorted by name, with what was skipped (see the module docstring)."""
    sel = _Selector(include, exclude, max_member_bytes, max_total_bytes)
    try:
        if path.suffix in (".zip", ".whl"):
            _read_zip(path, sel)
        else:
            _read_tar(path, sel)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as e:
        raise DataError(f"cannot read archive {path.name}: {e}") from None
    return sorted(sel.members, key=lambda m: m.name), sel.stats
