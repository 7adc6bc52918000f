"""A save that runs out of disk loses nothing: the state saved before is what a restart loads,
and no partial or temporary file is left behind."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from node.runtime.preflight import PreflightError, check_disk
from node.runtime.state import PeerState, load_state, save_state
from tests.support.small_disk import small_tmpfs


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs: room for one state file of `_state`, not two."""
    with small_tmpfs(tmp_path / "small") as where:
        yield where


def _state(window: int) -> PeerState:
    gen = torch.Generator().manual_seed(window)
    weights = {"w": torch.randn(96, 96, generator=gen)}  # 36 KiB of weights
    return PeerState("run", window, weights, {}, {}, f"fp{window}")


def test_a_save_that_fills_the_disk_keeps_the_state_saved_before(small_disk: Path) -> None:
    save_state(small_disk, _state(3))
    with pytest.raises(OSError) as failed:
        save_state(small_disk, _state(4))
    assert failed.value.errno == errno.ENOSPC
    back = load_state(small_disk, "run")
    assert back is not None and back.window == 3
    assert torch.equal(back.model["w"], _state(3).model["w"])
    leftovers = [p.name for p in small_disk.iterdir() if "tmp" in p.name]
    assert leftovers == []


def test_a_node_refuses_to_start_on_a_disk_without_room_for_its_state(small_disk: Path) -> None:
    """Checked before anything is written to a bucket or the chain, in one line with the fix."""
    with pytest.raises(PreflightError, match="free space or point --state-dir elsewhere"):
        check_disk(small_disk / "state", needed=1 << 20)
    check_disk(small_disk / "state", needed=1 << 10)  # room enough: no complaint
