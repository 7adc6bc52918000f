"""Stopping a node on SIGTERM (`docker compose stop`, torchrun passing it on) between two saves.

`install_stop_handler()` turns SIGTERM into `Stopped`, raised in the main thread at the next Python
instruction, unless a `deferred_stop()` block is running (every state save is one: see
`node.runtime.state.save_rotating`); then it is raised when the outermost block ends, so the save
completes first. A stopped node's state on disk is the last window it finished, and starting it
again resumes from there.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["Stopped", "deferred_stop", "install_stop_handler"]


class Stopped(BaseException):  # like KeyboardInterrupt: `except Exception` lets it pass
    """The process was asked to stop (SIGTERM); raised outside any state save."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        super().__init__(f"stopped by {signal.Signals(signum).name}")


_depth = 0
_pending: int | None = None


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    global _pending
    if _depth:
        _pending = signum
        return
    raise Stopped(signum)


@contextmanager
def deferred_stop() -> Iterator[None]:
    """A block a stop request does not interrupt; the request is raised when it ends."""
    global _depth, _pending
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
    if _depth == 0 and _pending is not None:
        signum, _pending = _pending, None
        raise Stopped(signum)


def install_stop_handler() -> None:
    """Route SIGTERM to `Stopped` (main thread only; elsewhere the default action stays)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
