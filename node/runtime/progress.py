"""Progress display for long local work (corpus extraction, tokenizer training, shard prep).

Bars go to stderr and only when stderr is a terminal, so logs, tests and the many processes of a
simulation stay clean; `TESSERA_PROGRESS=1` forces them on, `TESSERA_PROGRESS=0` off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    track,
)

__all__ = ["make_progress", "progress_enabled", "tracked"]

T = TypeVar("T")
PROGRESS_ENV = "TESSERA_PROGRESS"


def progress_enabled() -> bool:
    """Whether to draw progress bars (see the module docstring)."""
    forced = os.environ.get(PROGRESS_ENV)
    if forced is not None:
        return forced.strip() not in ("", "0", "false", "no")
    return sys.stderr.isatty()


def tracked(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate `items` with a transient progress bar on stderr (when enabled)."""
    yield from track(
        items,
        description=description,
        total=total,
        console=Console(stderr=True),
        transient=True,
        disable=not progress_enabled(),
    )


def make_progress(*, enabled: bool | None = None, in_bytes: bool = False) -> Progress:
    """A rich `Progress` with count (or bytes), bar, elapsed and remaining time, on stderr."""
    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        DownloadColumn() if in_bytes else MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        disable=not (progress_enabled() if enabled is None else enabled),
    )
