"""Downloads pinned by size and SHA-256 into the cache, resumable, verified before any use.

`fetch_pinned(url, filename, size, sha256)` returns ``<cache>/downloads/<sha256>/<filename>``.
The bytes go to a ``.part`` file beside it; an interrupted download resumes from where it
stopped (an HTTP ``Range`` request; a server that ignores it sends the whole file again). A file
is renamed into place only once it has exactly the pinned size and SHA-256; one that does not is
deleted and refused, so nothing downstream ever reads unverified bytes. A cached file is checked
against its SHA-256 again on every use.
"""

from __future__ import annotations

import logging
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from node.data.shards import DataError, file_sha256
from node.runtime.cache import cache_root, entry_lock

__all__ = ["download_path", "fetch_pinned"]

log = logging.getLogger(f"tessera.{__name__}")

_CHUNK = 1 << 20
_TIMEOUT_S = 60.0


def download_path(filename: str, sha256: str, cache_dir: str | os.PathLike[str] | None) -> Path:
    """Where `fetch_pinned` keeps a verified download."""
    return cache_root(cache_dir) / "downloads" / sha256 / filename


def _sha256_of(path: Path) -> str:
    return file_sha256(path) if path.is_file() else ""


def _transfer(url: str, part: Path, size: int, on_bytes: Callable[[int], None]) -> None:
    """Append the rest of `url` to `part` (or rewrite it), never beyond `size` bytes."""
    have = part.stat().st_size if part.is_file() else 0
    if have > size:
        part.unlink()
        have = 0
    if have == size:
        return
    request = urllib.request.Request(url, headers={"User-Agent": "tessera-corpus"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
        resumed = have > 0 and getattr(response, "status", None) == 206
        if not resumed:
            have = 0
        on_bytes(have)
        with part.open("ab" if resumed else "wb") as f:
            while chunk := response.read(_CHUNK):
                have += len(chunk)
                if have > size:
                    raise DataError(
                        f"{url} sends more than the {size:,} bytes its recipe pins; refusing it"
                    )
                f.write(chunk)
                on_bytes(have)


def fetch_pinned(
    url: str,
    filename: str,
    size: int,
    sha256: str,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> Path:
    """The verified local copy of `url` (see the module docstring); `on_bytes` sees progress."""
    dest = download_path(filename, sha256, cache_dir)
    with entry_lock(dest):
        if dest.is_file():
            if _sha256_of(dest) == sha256:
                on_bytes(size)
                return dest
            log.warning("cached %s fails its sha256; downloading it again", dest)
            dest.unlink()
        part = dest.with_name(dest.name + ".part")
        try:
            _transfer(url, part, size, on_bytes)
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", None) or e
            raise DataError(f"cannot download {url}: {reason} (run again to resume)") from None
        got = part.stat().st_size if part.is_file() else 0
        if got != size:
            raise DataError(
                f"download of {url} stopped at {got:,} of {size:,} bytes (run again to resume)"
            )
        actual = _sha256_of(part)
        if actual != sha256:
            part.unlink()
            raise DataError(
                f"{filename} has sha256 {actual}, not the {sha256} its recipe pins: refused "
                "(the file at its URL changed, or the recipe pins the wrong hash)"
            )
        os.replace(part, dest)
    log.info("downloaded %s (%s bytes, sha256 verified)", filename, f"{size:,}")
    return dest
