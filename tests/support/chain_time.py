"""A chain clock for the manifest-rule tests: one block further at every look, and block
timestamps a block time apart on the wall clock, from a chosen start."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta


class SteppingChain:
    """`block()` returns `first`, then one block more at every call (running `on[b]` the first
    time block b is seen); block b's timestamp is `first_at` plus `block_s` per block after
    `first` (default: now, so blocks ahead of `first` lie in the future)."""

    def __init__(
        self,
        first: int,
        on: dict[int, Callable[[], None]] | None = None,
        *,
        block_s: float = 1.0,
        first_at: datetime | None = None,
        stop_at: int | None = None,
    ) -> None:
        self.first, self.block_s = first, block_s
        self.first_at = first_at or datetime.now(UTC)
        self._next, self._hooks, self._stop = first, dict(on or {}), stop_at
        self.seen: list[int] = []

    def block(self) -> int:
        b = self._next
        if self._stop is None or b < self._stop:
            self._next += 1
        if b in self._hooks:
            self._hooks.pop(b)()
        self.seen.append(b)
        return b

    def block_timestamp(self, block: int) -> datetime:
        return self.first_at + timedelta(seconds=(block - self.first) * self.block_s)
