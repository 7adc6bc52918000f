"""Windows, deadlines and their wall-clock times."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.runconfig import RunConfig
from protocol.windows import (
    WindowSchedule,
    blocks_until_deadline,
    chain_timestamp_to_s,
    deadline_block,
    estimate_block_time,
    first_block,
    last_block,
    to_epoch_seconds,
    window_of_block,
)


def test_window_boundaries() -> None:
    assert window_of_block(0, 10) == 0
    assert window_of_block(9, 10) == 0
    assert window_of_block(10, 10) == 1
    assert first_block(3, 10) == 30
    assert last_block(3, 10) == 39
    assert deadline_block(3, 10, 2) == 42
    assert blocks_until_deadline(40, 3, 10, 2) == 2
    assert blocks_until_deadline(43, 3, 10, 2) == -1


@given(
    block=st.integers(0, 10**12),
    bpw=st.integers(1, 10**4),
)
def test_block_lies_in_its_window(block: int, bpw: int) -> None:
    w = window_of_block(block, bpw)
    assert first_block(w, bpw) <= block <= last_block(w, bpw)
    assert last_block(w, bpw) + 1 == first_block(w + 1, bpw)


@pytest.mark.parametrize(
    "call",
    [
        lambda: window_of_block(-1, 10),
        lambda: window_of_block(5, 0),
        lambda: first_block(-1, 10),
        lambda: deadline_block(1, 10, -1),
        lambda: estimate_block_time(1, 0, 0.0, 0.0),
        lambda: estimate_block_time(1, 0, float("nan"), 12.0),
    ],
)
def test_bad_inputs_raise_value_error(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_wall_clock_deadline_from_window_start() -> None:
    # window 5 starts at block 50, stamped t0; deadline block 52 + 10 = 62 -> 12 blocks later
    t0 = 1_700_000_000.0
    assert deadline_block(5, 10, 2) == 62
    assert estimate_block_time(62, 50, t0, 12.0) == t0 + 12 * 12.0
    # with the deadline block itself as anchor, its own timestamp is the deadline
    assert estimate_block_time(62, 62, t0 + 150.0, 12.0) == t0 + 150.0
    # anchors after the target block extrapolate backwards
    assert estimate_block_time(50, 60, t0 + 120.0, 12.0) == t0


def test_schedule_from_run_config() -> None:
    run = RunConfig.preset("tiny")
    s = WindowSchedule.from_run(run)
    bpw, dl = run.timing.blocks_per_window, run.timing.upload_deadline_blocks
    assert s.window_of(bpw * 7 + 1) == 7
    assert s.first_block(7) == 7 * bpw
    assert s.last_block(7) == 8 * bpw - 1
    assert s.deadline_block(7) == 8 * bpw + dl


def test_time_conversions() -> None:
    dt = datetime(2025, 1, 1, 12, 0, 0, tzinfo=UTC)
    assert to_epoch_seconds(dt) == dt.timestamp()
    other_zone = dt.astimezone(timezone(timedelta(hours=5)))
    assert to_epoch_seconds(other_zone) == to_epoch_seconds(dt)
    assert to_epoch_seconds(12) == 12.0
    with pytest.raises(ValueError):
        to_epoch_seconds(datetime(2025, 1, 1))
    with pytest.raises(TypeError):
        to_epoch_seconds("12")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        to_epoch_seconds(True)
    assert chain_timestamp_to_s(1_700_000_000_123) == 1_700_000_000.123
    with pytest.raises(ValueError):
        chain_timestamp_to_s(-1)
