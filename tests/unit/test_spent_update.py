"""A peer's own update is spent once sent (`miner.peer.Peer._land`): whether the window applied
it, applied only others' or applied nothing, its error feedback stays as its encode left it.
Put back into error feedback, an update left out came back in a later window beside that
window's own pseudo-gradient, measured from weights the run had left, and the model overshot:
with two of four peers left out of a launch's first windows, the held-out loss was 1.049 × the
clean run's in window 2 (`scripts/experiments/excluded_updates.py`); and after k windows that
applied nothing, k + 1 copies came back at once.

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
    peer._encode(origin, WINDOW)
    before = sum(
        float(e.double().square().sum()) for e in peer.strategy.encoder.local_state_dict().values()
    )
    members = {"ours": [peer.uid, peer.uid + 1], "others": [peer.uid + 1], "nothing": []}[applied]
    agreement = Agreement(dict.fromkeys(members), None, False, f"test: {applied}")  # type: ignore[arg-type]
    outcome = Exchanged(0, 0.0, {}, agreement)
    peer.exchange.launch(Flight(WINDOW, "start", None, lambda _: outcome, background=False))
    peer._land()
    after = sum(
        float(e.double().square().sum()) for e in peer.strategy.encoder.local_state_dict().values()
    )
    return before, after


@pytest.mark.parametrize("applied", ["ours", "others", "nothing"])
def test_an_update_sent_is_spent_whatever_the_window_applied(tmp_path: Path, applied: str) -> None:
    before, after = _error_feedback_after_landing(tmp_path, applied)
    assert before > 0 and after == before
