"""`tessera sim --faults`: a bad list ends in one line naming the known faults, a run too short
for a fault says how many windows it needs; the `load` fault runs busy loops until stopped; a
restarted member stops at the run's last window."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from lab.sim.faults import (
    FAULT_KINDS,
    WINDOWS_NEEDED,
    Injector,
    default_blocks_per_window,
    parse_faults,
)
from lab.sim.layout import build_world
from lab.sim.processes import Running
from node.runtime.report_log import REPORTS
from protocol.windows import WindowSchedule


def test_known_faults_parse_and_unknown_ones_are_named() -> None:
    assert parse_faults("store-errors,load", 1) == ["store-errors", "load"]
    assert parse_faults("", 1) == []
    with pytest.raises(SystemExit, match="unknown faults: disk-fire") as bad:
        parse_faults("load,disk-fire", 8)
    assert all(kind in str(bad.value) for kind in FAULT_KINDS)


def test_under_load_the_default_window_is_longer_by_the_share_the_busy_loops_take() -> None:
    """Two busy loops on two cores leave every node half the machine: windows twice as long;
    on sixteen cores they take an eighth."""
    assert default_blocks_per_window(["store-errors"], cores=2) == 30
    assert default_blocks_per_window(["store-errors", "load"], cores=2) == 60
    assert default_blocks_per_window(["load"], cores=16) == 34


@pytest.mark.parametrize("kind", sorted(WINDOWS_NEEDED))
def test_a_run_too_short_for_a_fault_says_how_many_windows_it_needs(kind: str) -> None:
    needed = WINDOWS_NEEDED[kind]
    with pytest.raises(SystemExit, match=f"--faults {kind} needs --windows {needed} or more"):
        parse_faults(kind, needed - 1)
    assert parse_faults(kind, needed) == [kind]


def test_the_load_fault_keeps_two_busy_loops_until_stopped(tmp_path: Path) -> None:
    world = build_world(tmp_path / "run", 2, 1.0, 30, 1, [], "file")
    injector = Injector(world, ["load"], validator_windows=3)
    hogs = [h.pid for h in injector._hogs]
    try:
        assert len(hogs) == 2 and all(_alive(pid) for pid in hogs)
    finally:
        injector.stop()
    assert not any(_alive(pid) for pid in hogs)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_restarted_member_stops_at_the_runs_last_window(tmp_path: Path) -> None:
    """A peer killed mid-run catches up to the chain's window without training the windows in
    between, so it is given the windows from there to the run's last (one more would outlive
    every validator, waiting for a decision nobody takes); a validator decides every window it
    missed, so it is given what it has not reported."""
    world = build_world(tmp_path / "run", 6, 1.0, 30, 2, [], "file")
    injector = Injector(world, [], validator_windows=7)  # peers train windows 0..5
    sched = WindowSchedule.from_run(world.run)
    done = subprocess.Popen(["true"])
    done.wait()
    peer, validator = world.of_kind("honest")[0], world.of_kind("validator")[0]
    for member, reported in ((peer, 2), (validator, 3)):
        member.state_dir.mkdir(parents=True)
        rows = "".join(json.dumps({"window": w}) + "\n" for w in range(reported))
        (member.state_dir / REPORTS).write_text(rows)
    in_window_3 = sched.first_block(3) + 10
    try:
        assert injector._windows_left(Running(peer, done, tmp_path / "p.log"), in_window_3) == 3
        assert injector._windows_left(Running(validator, done, tmp_path / "v.log"), 0) == 4
        last = sched.first_block(5) + 1  # a restart in the last window still trains it
        assert injector._windows_left(Running(peer, done, tmp_path / "p.log"), last) == 1
    finally:
        injector.stop()
