"""Append-only local logs (a node's ``reports.jsonl``) that never outgrow a size bound.

`append_line` adds one line with a single ``O_APPEND`` write and an fsync. Before a line would
take the file past `max_bytes`, the file is rotated: ``reports.jsonl`` becomes ``reports.jsonl.1``,
``.1`` becomes ``.2`` and so on, and the oldest beyond `keep` is deleted, each step one atomic
rename, so at most ``(keep + 1) * max_bytes`` bytes are kept and a crash mid-rotation loses
nothing (at worst a number is skipped). A line torn by a crash during its write is closed with a
newline before the next append, and `read_json_lines` skips it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from protocol.stores.atomic import fsync_dir, write_all

REPORTS = "reports.jsonl"
"""The name of a node's per-window report log in its state directory."""
MAX_BYTES = 32 << 20
KEEP = 4


def rotated(path: Path, n: int) -> Path:
    return path.with_name(f"{path.name}.{n}")


def _rotate(path: Path, keep: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(rotated(path, keep) if keep else path)
    for n in range(keep - 1, 0, -1):
        with contextlib.suppress(FileNotFoundError):
            os.replace(rotated(path, n), rotated(path, n + 1))
    if keep:
        os.replace(path, rotated(path, 1))
    fsync_dir(path.parent)


def append_line(
    path: str | os.PathLike[str], line: str, *, max_bytes: int = MAX_BYTES, keep: int = KEEP
) -> None:
    """Append `line` (no newline inside) to `path`, rotating first if it would pass `max_bytes`."""
    if "\n" in line:
        raise ValueError("a log line cannot contain a newline")
    if max_bytes < 1 or keep < 0:
        raise ValueError("max_bytes must be >= 1 and keep >= 0")
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = (line + "\n").encode("utf-8")
    try:
        size = target.stat().st_size
    except FileNotFoundError:
        size = 0
    if size and size + len(data) > max_bytes:
        _rotate(target, keep)
        size = 0
    fd = os.open(target, os.O_RDWR | os.O_APPEND | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if size and os.pread(fd, 1, size - 1) != b"\n":
            data = b"\n" + data  # a torn last line from a crash: close it
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def log_files(path: str | os.PathLike[str]) -> list[Path]:
    """The log and its rotated files, oldest first."""
    target = Path(path)
    pattern = re.compile(rf"{re.escape(target.name)}\.([1-9][0-9]*)")
    olds = []
    if target.parent.is_dir():
        for p in target.parent.iterdir():
            m = pattern.fullmatch(p.name)
            if m is not None:
                olds.append((int(m[1]), p))
    files = [p for _, p in sorted(olds, reverse=True)]
    return [*files, target] if target.exists() else files


def read_json_lines(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every JSON line of the log and its rotated files, oldest first (torn lines skipped)."""
    out = []
    for file in log_files(path):
        for line in file.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out
