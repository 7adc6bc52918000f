"""What a killed save leaves in a node's state directory (a full-size temporary file) is removed
when the node starts, and nothing else is."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from commands.node_args import state_dir
from node.runtime.atomic_files import write_bytes_atomic
from protocol.runconfig import RunConfig
from protocol.stores.atomic import temp_name


def test_a_killed_saves_temporaries_go_at_start_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    write_bytes_atomic(state / "state.pt", b"the saved state")
    (state / temp_name()).write_bytes(b"\0" * (1 << 20))  # a save cut short by kill -9
    (state / temp_name()).mkdir()  # an atomic folder cut short
    (state / "reports.jsonl").write_text("{}\n")
    args = argparse.Namespace(state_dir=str(state))
    with caplog.at_level("WARNING"):
        assert state_dir(args, "miner", RunConfig.preset("tiny"), "hotkey") == state
    assert sorted(p.name for p in state.iterdir()) == ["reports.jsonl", "state.pt"]
    assert (state / "state.pt").read_bytes() == b"the saved state"
    assert caplog.text.count("left by an interrupted save") == 2
    # a directory that does not exist yet is left alone
    assert state_dir(argparse.Namespace(state_dir=str(tmp_path / "new")), "miner",
                     RunConfig.preset("tiny"), "hotkey") == tmp_path / "new"  # fmt: skip
