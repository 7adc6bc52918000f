"""A state file whose bytes changed on disk is refused for the previous one, and the log says so;
a state without its checksum (a kill between the two writes, or a file of an older version)
still loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from node.runtime.state import PREVIOUS_FILE, STATE_FILE, PeerState, load_state, save_state


def _state(window: int) -> PeerState:
    gen = torch.Generator().manual_seed(window)
    weights = {"w": torch.randn(64, 64, generator=gen)}
    return PeerState("run", window, weights, {}, {}, f"fp{window}")


def test_a_flipped_byte_falls_back_to_the_previous_state(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_state(tmp_path, _state(3))
    save_state(tmp_path, _state(4))
    assert load_state(tmp_path, "run").window == 4  # type: ignore[union-attr]
    data = bytearray((tmp_path / STATE_FILE).read_bytes())
    # a bit of one weight, inside the stored tensor data (torch.load accepts the file as it is)
    at = data.index(_state(4).model["w"].numpy().tobytes()[:64]) + 100
    data[at] ^= 0x10
    (tmp_path / STATE_FILE).write_bytes(bytes(data))
    torch.load(tmp_path / STATE_FILE, weights_only=True)  # the flip alone is not caught by torch
    with caplog.at_level("WARNING"):
        state = load_state(tmp_path, "run")
    assert state is not None and state.window == 3
    assert torch.equal(state.model["w"], _state(3).model["w"])
    assert "does not match its checksum" in caplog.text and STATE_FILE in caplog.text


def test_a_state_without_its_checksum_still_loads(tmp_path: Path) -> None:
    save_state(tmp_path, _state(5))
    (tmp_path / (STATE_FILE + ".b2")).unlink()  # killed between the state and its checksum
    state = load_state(tmp_path, "run")
    assert state is not None and state.window == 5
    assert not (tmp_path / (PREVIOUS_FILE + ".b2")).exists()
