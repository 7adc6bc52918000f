"""When a simulation's window 0 opens. `tessera sim --start-block`: a run with adversaries and a clean run started at the same block
share the run id and the members' hotkeys, so their honest peers (the first uids) train on the
same samples under the same hotkeys, and the validator scores both on the same held-out set: a
paired comparison. By default window 0 opens as soon as every member is up."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lab.sim.layout import NETUID, build_world, startup_blocks
from lab.sim.opening import READY_MARGIN_S, Opening
from protocol.chain.local import LocalChain
from protocol.keys import load_hotkey


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


def test_window_0_opens_once_every_member_has_committed(tmp_path: Path) -> None:
    """The chain skips its start-up allowance once the last member is up (its commitment on
    chain), to `READY_MARGIN_S` before window 0; not a block earlier, and only once."""
    world = build_world(tmp_path / "run", 2, 1.0, 60, 2, ["noise"], "file")
    chain = LocalChain(world.chain_url.removeprefix("local://"), NETUID)
    opening = Opening(world)
    *first, last = world.members
    for m in first:
        chain.commit(load_hotkey("sim", m.name, world.out / "wallets"), b"up")
        assert opening.tick() is None  # someone is still starting: the clock keeps its pace
    assert chain.block() < startup_blocks(len(world.members), 1.0) - 20
    chain.commit(load_hotkey("sim", last.name, world.out / "wallets"), b"up")
    line = opening.tick()
    assert line is not None and f"all {len(world.members)} members are up" in line
    margin = math.ceil(READY_MARGIN_S / 1.0)
    assert chain.block() == world.run.timing.start_block - margin
    assert opening.tick() is None and opening.opened  # once
    opening.close()
    chain.close()
