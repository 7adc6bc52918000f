"""A peer stops once its run is over: a window past ``outer.total_windows − 1`` is never trained,
however many windows it was asked for (a peer that missed windows, to a fault or a slow start,
would otherwise train past the run's end, where no validator decides)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from protocol.chain.local_db import LocalChainDB
from protocol.runconfig import RunConfig
from tests.support.local_peer import local_peer

RUN = RunConfig.preset(
    "tiny",
    name="run-over",
    inner_steps=1,
    outer={"total_windows": 3},
    timing={"block_time_s": 0.5, "blocks_per_window": 4, "upload_deadline_blocks": 1},
)


def test_a_peer_past_the_runs_last_window_trains_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    peer = local_peer(tmp_path, RUN)
    chain = LocalChainDB(tmp_path / "chain.db")
    chain.fast_forward(peer.clock.schedule.first_block(3))  # window 3: the run had 0..2
    chain.close()
    with caplog.at_level(logging.INFO, logger="tessera"):
        assert peer.run(5) == []
    assert "the run is over: its last window, 2, has passed" in caplog.text
    assert not (tmp_path / "state" / "reports.jsonl").exists()


def test_a_peer_that_gives_up_catching_up_trains_the_window_open_by_then(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A peer that wakes in window 1's last block, with no history to replay window 0, waits a
    window for one; by then window 2 is open, and window 1's upload would be late."""
    run = RUN.model_copy(update={"outer": RUN.outer.model_copy(update={"total_windows": 10})})
    peer = local_peer(tmp_path, run)
    chain = LocalChainDB(tmp_path / "chain.db")
    schedule = peer.clock.schedule
    chain.fast_forward(schedule.first_block(2) - 1)
    chain.close()
    with caplog.at_level(logging.INFO, logger="tessera"):
        (report,) = peer.run(1)
    assert "missed windows 0..1" in caplog.text
    assert report.window >= 2
