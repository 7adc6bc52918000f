"""`tessera sim --faults`: a bad list ends in one line naming the known faults, a run too short
for a fault says how many windows it needs; the `load` fault runs busy loops until stopped."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lab.sim.faults import FAULT_KINDS, WINDOWS_NEEDED, Injector, parse_faults
from lab.sim.layout import build_world


def test_known_faults_parse_and_unknown_ones_are_named() -> None:
    assert parse_faults("store-errors,load", 1) == ["store-errors", "load"]
    assert parse_faults("", 1) == []
    with pytest.raises(SystemExit, match="unknown faults: disk-fire") as bad:
        parse_faults("load,disk-fire", 8)
    assert all(kind in str(bad.value) for kind in FAULT_KINDS)


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
