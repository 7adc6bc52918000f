"""A peer's exchange from one window to the next: named states and every transition in one place.

Each window the peer encodes its update and sends it up; the exchange (`miner.flight.Flight`)
comes down, or **lands**, once the window's set is agreed: at once with ``outer.delay = 0``,
during the next window's training with ``delay = 1`` (docs/training.md). `ExchangeCycle` holds
that exchange and where it is (`ExchangeState`):

- ``idle``: nothing in the air and no mean held;
- ``in the air``: our update's exchange runs (`Flight.step` says where: uploading, gathering…);
- ``landed``: it agreed on the start we trained from; its mean is being taken in;
- ``forked``: it landed from a start the lead validator did not share: the model is rebuilt from
  the validators' history once the window is encoded (the next window's exchange may go up
  before that);
- ``held``: a window's mean is held by the outer step (`node.strategy.outer`) for the next step:
  taken in from a landing, or left by a saved state or a history replay.

The transitions (`TRANSITIONS` lists where each may start; from anywhere else it is refused with
`IllegalTransition`)::

    launch     idle → in the air; forked → forked      our update goes up (one at a time)
    resume     idle → in the air                       a restarted peer's saved exchange goes up
    land       in the air → landed | forked            it is waited for: did it agree on our start?
    resync     forked → landed                         the model rebuilt from the validators' history
    take_in    landed → held                           its mean held by the outer step
    step       held → idle | in the air                the outer step takes the held mean
    replayed   idle | held → idle | held               a saved state or a replay set the outer state
    report     idle | in the air                       the window is over: its landing, if any, read

With ``delay = 0`` a window goes idle, launch, land, take_in, step: idle again. With ``delay = 1``
window ``w``'s exchange lands and steps while window ``w + 1`` trains, before its own launch; a
fork lands there too and is resynced after that launch. The peer (`miner.peer.Peer`) does the
work each transition names (waits, computes the mean, rebuilds, moves its weights) through the
callables it hands in; the cycle checks the order and keeps the state, which the peer's window
log line and its metrics (`miner.metrics`) show.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

import torch

from miner.flight import Flight, FlightStep, IllegalTransition
from node.strategy.outer import OuterOptimizer

__all__ = [
    "FORKED",
    "HELD",
    "IDLE",
    "IN_THE_AIR",
    "LANDED",
    "TRANSITIONS",
    "ExchangeCycle",
    "ExchangeState",
    "IllegalTransition",
]

Tensors = Mapping[str, torch.Tensor]


class ExchangeState(StrEnum):
    """Where a peer's exchange is (the module docstring)."""

    IDLE = "idle"
    IN_THE_AIR = "in the air"
    LANDED = "landed"
    FORKED = "forked"
    HELD = "held"


IDLE, IN_THE_AIR, LANDED, FORKED, HELD = ExchangeState

TRANSITIONS: dict[str, frozenset[ExchangeState]] = {
    "launch": frozenset({IDLE, FORKED}),
    "resume": frozenset({IDLE}),
    "land": frozenset({IN_THE_AIR}),
    "resync": frozenset({FORKED}),
    "take_in": frozenset({LANDED}),
    "step": frozenset({HELD}),
    "replayed": frozenset({IDLE, HELD}),
    "report": frozenset({IDLE, IN_THE_AIR}),
}
"""The states each transition may start from."""


class ExchangeCycle:
    """One peer's exchange and its state (see the module docstring)."""

    def __init__(self, outer: OuterOptimizer) -> None:
        self.outer = outer  # what holds a landed window's mean until the next step
        self.state = IDLE
        self.air: Flight | None = None  # our update's exchange while it is in the air
        self.landed: Flight | None = None  # the last to land, until the window's report

    # -- the transitions ---------------------------------------------------------------------

    def launch(self, flight: Flight) -> None:
        """Our update's exchange goes up (after a fork's landing, before its resync)."""
        self._require("launch")
        if self.air is not None:
            raise IllegalTransition(
                f"cannot launch window {flight.window}'s exchange: window {self.air.window}'s is "
                "in the air"
            )
        self.air = flight
        if self.state is IDLE:
            self.state = IN_THE_AIR
        flight.start()

    def resume(self, flight: Flight) -> None:
        """A restarted peer's saved exchange goes up again."""
        self._require("resume")
        self.air, self.state = flight, IN_THE_AIR
        flight.start()

    def land(self, forked: Callable[[Flight], bool]) -> ExchangeState:
        """Wait for the exchange in the air (`forked` waits for its outcome and says whether it
        agreed on a start other than ours): ``landed``, or ``forked``."""
        self._require("land")
        flight = self.air
        assert flight is not None  # in the air
        off = forked(flight)
        self.air, self.landed = None, flight
        self.state = FORKED if off else LANDED
        return self.state

    def resync(self, rebuild: Callable[[Flight], None]) -> None:
        """The forked landing's start rebuilt (`rebuild`: from the validators' history)."""
        self._require("resync")
        assert self.landed is not None  # forked: it landed
        rebuild(self.landed)
        self.state = LANDED

    def take_in(self, mean: Callable[[Flight], Tensors]) -> None:
        """The landing's mean (`mean` computes it) held by the outer step for the next step."""
        self._require("take_in")
        assert self.landed is not None  # it landed
        self.outer.receive(mean(self.landed), self.landed.window)
        self.state = HELD

    def step(self, origin: Tensors) -> dict[str, torch.Tensor]:
        """The outer step from `origin` with the held mean, which it releases: the new weights."""
        self._require("step")
        new = self.outer.next_weights(origin)
        self.state = IN_THE_AIR if self.air is not None else IDLE
        return new

    def replayed(self) -> None:
        """A saved state or a history replay set the outer state: a mean it holds is the next
        step's."""
        self._require("replayed")
        if self.air is not None:
            raise IllegalTransition("cannot replay history while an exchange is in the air")
        self.state = HELD if self.outer.holding else IDLE

    def report(self) -> Flight | None:
        """The window is over: the exchange that landed in it (None if none did), read once."""
        self._require("report")
        landed, self.landed = self.landed, None
        return landed

    # -- reading it --------------------------------------------------------------------------

    def record(self) -> dict[str, Any]:
        """What the saved state keeps of the exchange in the air (`Flight.record`; {} if none)."""
        return self.air.record() if self.air is not None else {}

    @property
    def step_in_the_air(self) -> FlightStep | None:
        """Where the exchange in the air is (None when none is)."""
        air = self.air  # read once: its exchange thread may land it meanwhile
        return air.step if air is not None else None

    def describe(self) -> str:
        """The state in words, e.g. ``window 7 in the air (gathering)``, ``window 6 forked``."""
        air, landed, state = self.air, self.landed, self.state
        flying = f"window {air.window} in the air ({air.step})" if air is not None else ""
        if state in (IDLE, IN_THE_AIR):
            return flying or "idle"
        done = "mean held" if state is HELD or landed is None else f"window {landed.window} {state}"
        return f"{done}; {flying}" if flying else done

    def _require(self, transition: str) -> None:
        if self.state not in TRANSITIONS[transition]:
            raise IllegalTransition(
                f"cannot {transition.replace('_', ' ')} the exchange while it is {self.state}"
            )
