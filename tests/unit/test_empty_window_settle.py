"""A peer's own update that the window did not apply goes back into its error feedback, unless
the window applied nothing at all (`miner.peer.Peer._land`): then no model moved, the next
window's update measured from the same origin carries it again, and adding it back too would
send it twice (after k empty windows, k + 1 times at once: the simulation's held-out loss
jumped from 7.37 to 9.27 after two windows without a manifest).

A real peer (embedded chain and store, the `tiny` model, error feedback in use) encodes a
trained update, and its exchange lands with a real agreement of each kind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from miner.flight import Exchanged, Flight
from node.window.consensus import Agreement
from protocol.runconfig import RunConfig
from tests.support.local_peer import local_peer

WINDOW = 3  # past the error feedback's freeze


def _error_feedback_after_landing(tmp_path: Path, applied: str) -> tuple[float, float]:
    """The error feedback's squared norm before and after our update of `WINDOW` lands with
    `applied`: ``"ours"``, ``"others"`` (a set without us) or ``"nothing"``."""
    run = RunConfig.preset("tiny", name="settle", outer={"ef_freeze_fraction": 0.0})
    peer = local_peer(tmp_path, run)
    origin = peer.weights.start()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # what training would have moved
        for p in peer.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    sent = peer._encode(origin, WINDOW)
    before = sum(
        float(e.double().square().sum()) for e in peer.strategy.local_state_dict().values()
    )
    members = {"ours": [peer.uid, peer.uid + 1], "others": [peer.uid + 1], "nothing": []}[applied]
    agreement = Agreement(dict.fromkeys(members), None, False, f"test: {applied}")  # type: ignore[arg-type]
    outcome = Exchanged(0, 0.0, {}, agreement)
    peer._flight = Flight(WINDOW, sent, "start", None, lambda: outcome, background=False)
    peer._land()
    after = sum(float(e.double().square().sum()) for e in peer.strategy.local_state_dict().values())
    return before, after


@pytest.mark.parametrize("applied", ["ours", "nothing"])
def test_an_update_applied_or_a_window_that_applied_nothing_leaves_error_feedback(
    tmp_path: Path, applied: str
) -> None:
    before, after = _error_feedback_after_landing(tmp_path, applied)
    assert before > 0 and after == before


def test_an_update_left_out_of_an_applied_set_goes_back(tmp_path: Path) -> None:
    before, after = _error_feedback_after_landing(tmp_path, "others")
    assert after > 1.05 * before  # the sent top-k mass is back
