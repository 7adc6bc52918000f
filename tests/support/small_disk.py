"""A small tmpfs for the disk-full tests (skipped where mounting is not allowed)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, size: str = "64k") -> Iterator[Path]:
    """`where` as a tmpfs of `size`, unmounted on exit; the test is skipped, saying why, where
    this machine does not let it mount one."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)
