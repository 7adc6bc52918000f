"""The phases of a window, each logged with its duration as it ends, so an operator can read in
a plain log where a window's time goes (`tessera miner` at the default INFO level)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from node.runtime.logs import fields

__all__ = ["Phases"]


class Phases:
    """``with phases("train"): ...`` logs ``window 7: train 41.2 s`` and keeps the seconds."""

    def __init__(self, window: int, log: logging.Logger, what: str = "window") -> None:
        self.window, self.log, self.what = window, log, what
        self.seconds: dict[str, float] = {}
        self._begun = time.monotonic()

    @contextmanager
    def __call__(self, name: str, detail: str = "") -> Iterator[None]:
        begun = time.monotonic()
        try:
            yield
        finally:
            took = time.monotonic() - begun
            self.seconds[name] = self.seconds.get(name, 0.0) + took
            extra = f" ({detail})" if detail else ""
            self.log.info(
                "%s %d: %s %.1f s%s", self.what, self.window, name, took, extra,
                extra=fields(window=self.window, phase=name, seconds=took),
            )  # fmt: skip

    @property
    def elapsed(self) -> float:
        """Seconds since the phases began."""
        return time.monotonic() - self._begun
