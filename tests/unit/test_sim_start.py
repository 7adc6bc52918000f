"""`tessera sim --start-block`: a run with adversaries and a clean run started at the same block
share the run id and the members' hotkeys, so their honest peers (the first uids) train on the
same samples under the same hotkeys, and the validator scores both on the same held-out set: a
paired comparison."""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.sim.layout import build_world, startup_blocks


def test_the_same_start_block_gives_the_same_run_whatever_else_joins(tmp_path: Path) -> None:
    crowd = ["noise", "split", "split"]
    clean = build_world(tmp_path / "clean", 4, 1.0, 60, 2, [], "file", start_block=90)
    attacked = build_world(tmp_path / "attacked", 4, 1.0, 60, 2, crowd, "file", start_block=90)
    assert clean.run.run_id == attacked.run.run_id
    honest = [(m.uid, m.hotkey) for m in clean.of_kind("honest")]
    assert honest == [(m.uid, m.hotkey) for m in attacked.of_kind("honest")]
    # by default each starts when its own processes can have started: other runs
    default = build_world(tmp_path / "default", 4, 1.0, 60, 2, crowd, "file")
    assert default.run.timing.start_block == startup_blocks(6, 1.0)
    assert default.run.run_id != attacked.run.run_id
    again = build_world(tmp_path / "again", 4, 1.0, 60, 2, [], "file")
    assert {m.hotkey for m in again.members}.isdisjoint(m.hotkey for m in default.members)


def test_a_start_block_before_the_processes_are_up_is_refused(tmp_path: Path) -> None:
    needed = startup_blocks(3, 1.0)
    with pytest.raises(ValueError, match=f"need until block {needed}"):
        build_world(tmp_path / "early", 2, 1.0, 60, 2, [], "file", start_block=needed - 1)
    assert not (tmp_path / "early").exists()
