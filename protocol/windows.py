"""Windows (outer steps) from block numbers, and their wall-clock open and deadline times.

Conventions (B = blocks_per_window, D = upload_deadline_blocks, all integers >= 0):

- Window ``w`` covers blocks ``[w*B, (w+1)*B)``: ``window_of_block(b) = b // B``.
- The **deadline block** of ``w`` is ``(w+1)*B + D``: an update for ``w`` must be stored before
  the chain reaches that block, i.e. D blocks into window ``w+1``. Honest peers only learn
  ``θ(w-1)`` at the deadline of ``w-1``, so nothing for ``w`` can legitimately exist before the
  start of ``w``: the **open time** of ``w`` is the start of its first block.
- Wall-clock times are POSIX seconds (UTC). The chain stamps each block (``Timestamp.Now``, in
  ms). The time of a block we have not seen is estimated from an anchor block's timestamp plus
  ``block_time_s`` per block; once the deadline block exists, its own timestamp is
  authoritative (`estimate_block_time` with the deadline block as the anchor gives exactly that).
- Whether a stored update was late (its ``LastModified`` after the deadline time plus the run's
  ``clock_skew_tolerance_s``) is decided where it is fetched, in `node.window.gather`.

All functions are pure; they raise `ValueError` for negative blocks/windows or non-positive
window lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from protocol.runconfig import RunConfig, TimingConfig


def _check_bpw(blocks_per_window: int) -> None:
    if blocks_per_window < 1:
        raise ValueError(f"blocks_per_window must be >= 1, got {blocks_per_window}")


def _check_nonneg(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def window_of_block(block: int, blocks_per_window: int) -> int:
    """The window that contains `block`."""
    _check_bpw(blocks_per_window)
    _check_nonneg("block", block)
    return block // blocks_per_window


def first_block(window: int, blocks_per_window: int) -> int:
    """First block of `window`."""
    _check_bpw(blocks_per_window)
    _check_nonneg("window", window)
    return window * blocks_per_window


def last_block(window: int, blocks_per_window: int) -> int:
    """Last block of `window` (inclusive)."""
    return first_block(window + 1, blocks_per_window) - 1


def deadline_block(window: int, blocks_per_window: int, upload_deadline_blocks: int) -> int:
    """The block by whose start an update for `window` must be stored: (w+1)*B + D."""
    _check_nonneg("upload_deadline_blocks", upload_deadline_blocks)
    return first_block(window + 1, blocks_per_window) + upload_deadline_blocks


def blocks_until_deadline(
    current_block: int, window: int, blocks_per_window: int, upload_deadline_blocks: int
) -> int:
    """Blocks left before the deadline of `window` (negative once it has passed)."""
    _check_nonneg("current_block", current_block)
    return deadline_block(window, blocks_per_window, upload_deadline_blocks) - current_block


def estimate_block_time(
    block: int, anchor_block: int, anchor_timestamp_s: float, block_time_s: float
) -> float:
    """Estimated wall-clock start of `block` from a known block's chain timestamp."""
    _check_nonneg("block", block)
    _check_nonneg("anchor_block", anchor_block)
    if not (block_time_s > 0 and math.isfinite(block_time_s)):
        raise ValueError(f"block_time_s must be positive and finite, got {block_time_s}")
    if not math.isfinite(anchor_timestamp_s):
        raise ValueError("anchor_timestamp_s must be finite")
    return anchor_timestamp_s + (block - anchor_block) * block_time_s


def to_epoch_seconds(value: datetime | float | int) -> float:
    """POSIX seconds from an aware datetime (e.g. boto3's LastModified) or a number."""
    if isinstance(value, datetime):
        if value.tzinfo is None or value.utcoffset() is None:
            raise ValueError("naive datetimes are ambiguous; pass a timezone-aware datetime")
        return value.timestamp()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"expected datetime or number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError("time must be finite")
    return float(value)


def chain_timestamp_to_s(timestamp_ms: int) -> float:
    """Convert the chain's `Timestamp.Now` (milliseconds) to POSIX seconds."""
    if isinstance(timestamp_ms, bool) or not isinstance(timestamp_ms, int) or timestamp_ms < 0:
        raise ValueError(f"chain timestamp must be a non-negative int (ms), got {timestamp_ms!r}")
    return timestamp_ms / 1000.0


@dataclass(frozen=True, slots=True)
class WindowSchedule:
    """The timing part of a run config, with the functions above bound to it.

    Window 0 begins at `start_block` (the block the run was launched at); blocks before it belong
    to no window (`window_of` returns -1 for them).
    """

    blocks_per_window: int
    upload_deadline_blocks: int
    block_time_s: float
    clock_skew_tolerance_s: float
    start_block: int = 0

    @classmethod
    def from_timing(cls, timing: TimingConfig) -> WindowSchedule:
        return cls(
            blocks_per_window=timing.blocks_per_window,
            upload_deadline_blocks=timing.upload_deadline_blocks,
            block_time_s=timing.block_time_s,
            clock_skew_tolerance_s=timing.clock_skew_tolerance_s,
            start_block=timing.start_block,
        )

    @classmethod
    def from_run(cls, run: RunConfig) -> WindowSchedule:
        return cls.from_timing(run.timing)

    def window_of(self, block: int) -> int:
        if block < self.start_block:
            return -1
        return window_of_block(block - self.start_block, self.blocks_per_window)

    def first_block(self, window: int) -> int:
        return self.start_block + first_block(window, self.blocks_per_window)

    def last_block(self, window: int) -> int:
        return self.start_block + last_block(window, self.blocks_per_window)

    def deadline_block(self, window: int) -> int:
        return self.start_block + deadline_block(
            window, self.blocks_per_window, self.upload_deadline_blocks
        )

    @property
    def gather_grace_blocks(self) -> int:
        """Blocks between a window's deadline and its gather: enough to cover the clock-skew
        tolerance, so every on-time object is visible, plus one."""
        return math.ceil(self.clock_skew_tolerance_s / self.block_time_s) + 1

    def gather_block(self, window: int) -> int:
        """The block at which peers and validators read a window's uploads."""
        return self.deadline_block(window) + self.gather_grace_blocks
