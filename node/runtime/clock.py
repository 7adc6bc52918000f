"""Window timing against the chain's own clock, shared by peers and validators."""

from __future__ import annotations

import time

from protocol.chain.base import Chain
from protocol.runconfig import RunConfig
from protocol.windows import WindowSchedule, estimate_block_time


class ChainClock:
    """When a window opens, when its uploads are due, and when everyone gathers them."""

    def __init__(self, chain: Chain, run: RunConfig) -> None:
        self.chain = chain
        self.timing = run.timing
        self.schedule = WindowSchedule.from_run(run)

    def current_window(self) -> int:
        return self.schedule.window_of(self.chain.block())

    def wait_for_block(self, block: int) -> None:
        while self.chain.block() < block:
            time.sleep(min(1.0, self.timing.block_time_s / 4))

    def deadline_s(self, window: int) -> float:
        """The window's upload deadline in epoch seconds, from the chain's timestamps: the
        deadline block's own timestamp once it exists (what every node reads alike at the
        gather, however long the chain stalled before it), else estimated from the head a block
        time per block (a window trained ahead of the chain)."""
        deadline = self.schedule.deadline_block(window)
        anchor = min(deadline, self.chain.block())
        return estimate_block_time(
            deadline,
            anchor,
            self.chain.block_timestamp(anchor).timestamp(),
            self.timing.block_time_s,
        )

    def window_span_s(self, window: int) -> tuple[float, float]:
        """When the window opens and when it is gathered, in epoch seconds (from the deadline's
        timestamp, `deadline_s`, a block time per block either side)."""
        deadline, step = self.deadline_s(window), self.timing.block_time_s
        before = self.schedule.deadline_block(window) - self.schedule.first_block(window)
        after = self.schedule.gather_block(window) - self.schedule.deadline_block(window)
        return deadline - before * step, deadline + after * step

    def seconds_until(self, block: int) -> float:
        """Seconds from now until `block` starts, estimated from the head block's timestamp
        (negative once it has)."""
        head = self.chain.block()
        ts = self.chain.block_timestamp(head).timestamp()
        return estimate_block_time(block, head, ts, self.timing.block_time_s) - time.time()

    def gather_block(self, window: int) -> int:
        """The block at which peers and validators read a window's uploads: the deadline plus
        enough blocks to cover the clock-skew tolerance, so every on-time object is visible."""
        return self.schedule.gather_block(window)
