"""A settable clock for the embedded chain: tests move it to the middle of any block."""

from __future__ import annotations


class Clock:
    """Wall time for `protocol.chain.local`: starts at `genesis`, moved by `at(block)`."""

    def __init__(self, genesis: float, block_time: float) -> None:
        self.genesis, self.block_time = genesis, block_time
        self.now = genesis

    def __call__(self) -> float:
        return self.now

    def at(self, block: int) -> None:
        """The middle of `block`."""
        self.now = self.genesis + (block + 0.5) * self.block_time
