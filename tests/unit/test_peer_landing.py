"""With ``outer.delay = 1`` a peer waits for the exchange in the air after `land_by_step` inner
steps (`miner.peer.Peer._step_when_landed`): a delayed step that lands only after the window's
training made the schedule diverge (docs/training.md), in the simulation too.

The real peer (embedded chain and store, the `tiny` model) trains a window while the previous
window's exchange is still in the air. The exchange lands only once the peer has taken
`land_by_step` inner steps and then either taken another one or had `HOLD_S` seconds more, and
records how many inner steps the peer had taken by then: with the wait, exactly
`land_by_step` (the peer is blocked there until it lands); without it, the peer trains on."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from miner.exchange_cycle import IDLE
from miner.flight import Enter, Exchanged, Flight
from miner.peer import Peer
from node.strategy.outer import land_by_step
from node.window.consensus import Agreement
from protocol.runconfig import RunConfig
from tests.support.local_peer import local_peer

HOLD_S = 5.0  # how long the exchange stays in the air after the peer reached land_by_step


def _peer(tmp_path: Path) -> Peer:
    run = RunConfig.preset("tiny", name="landing", inner_steps=10, outer={"delay": 1})
    return local_peer(tmp_path, run)


def _inner_steps_done(optimizer: torch.optim.Optimizer) -> int:
    steps = [s["step"] for s in optimizer.state.values() if "step" in s]
    return int(steps[0]) if steps else 0


def test_a_delayed_exchange_lands_after_land_by_steps_not_after_training(tmp_path: Path) -> None:
    peer = _peer(tmp_path)
    due = land_by_step(peer.cfg.inner_steps)
    assert 0 < due < peer.cfg.inner_steps
    peer._origin = peer.weights.start()
    peer._encode(peer._origin, 0)  # window 0's update (zero: nothing trained yet)
    at_landing: list[int] = []

    def slow_exchange(_: Enter) -> Exchanged:
        while _inner_steps_done(peer.optimizer) < due:
            time.sleep(0.01)
        hold = time.monotonic() + HOLD_S
        while _inner_steps_done(peer.optimizer) == due and time.monotonic() < hold:
            time.sleep(0.01)
        at_landing.append(_inner_steps_done(peer.optimizer))
        return Exchanged(0, 0.0, {}, Agreement({}, None, False, "test: nothing agreed"))

    peer.exchange.launch(Flight(0, "start", None, slow_exchange, background=True))
    peer._train(1)
    assert peer.exchange.state is IDLE, "the exchange did not land and step during training"
    assert at_landing == [due], (at_landing, due)
    assert _inner_steps_done(peer.optimizer) == peer.cfg.inner_steps
