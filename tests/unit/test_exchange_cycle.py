"""A peer's exchange as named states (`miner.exchange_cycle`) and the flight's own steps
(`miner.flight.FlightStep`).

The sequences a peer goes through with ``outer.delay`` 0 and 1, a fork at either delay, a
restart and a history replay, each checked state by state and with the outer step it holds and
takes; every transition from every state it may not start from is refused and changes nothing.
A flight's step is readable while it runs and only goes forward; the peer's metrics serve both
at each scrape."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from codec.spec import ModelSpec
from miner.exchange_cycle import (
    FORKED,
    HELD,
    IDLE,
    IN_THE_AIR,
    LANDED,
    ExchangeCycle,
    ExchangeState,
    IllegalTransition,
)
from miner.flight import Enter, Exchanged, Flight, FlightStep
from miner.metrics import PeerMetrics
from node.strategy.outer import OuterOptimizer
from node.window.consensus import Agreement
from protocol.runconfig import RunConfig

SPEC = ModelSpec.from_shapes({"w": (4, 3)})
ORIGIN = {"w": torch.zeros(4, 3)}
MEAN = {"w": torch.ones(4, 3)}


def _cycle(delay: int = 0) -> ExchangeCycle:
    run = RunConfig.preset("tiny", name="cycle", outer={"delay": delay, "optimizer": "sgd"})
    return ExchangeCycle(OuterOptimizer(run, SPEC))


def _flight(window: int, forked: bool = False) -> Flight:
    outcome = Exchanged(0, 0.0, {}, Agreement({}, None, forked, "test"))
    return Flight(window, "start", None, lambda _: outcome, background=False)


def _forked(flight: Flight) -> bool:
    done = flight.result()
    assert done is not None
    return done.agreed.forked


def _mean(_: Flight) -> dict[str, torch.Tensor]:
    return dict(MEAN)


def _stepped(cycle: ExchangeCycle) -> None:
    """The outer step from ORIGIN took the held mean (and released it)."""
    new = cycle.step(ORIGIN)
    alpha = cycle.outer.cfg.alpha
    assert torch.equal(new["w"], ORIGIN["w"] - alpha * MEAN["w"])
    assert not cycle.outer.holding


def test_with_delay_0_a_window_goes_up_lands_is_taken_in_and_steps() -> None:
    cycle = _cycle(delay=0)
    assert cycle.state is IDLE
    cycle.launch(_flight(0))
    assert cycle.state is IN_THE_AIR
    assert cycle.land(_forked) is LANDED and cycle.air is None
    cycle.take_in(_mean)
    assert cycle.state is HELD and cycle.outer.holding
    _stepped(cycle)
    assert cycle.state is IDLE
    landed = cycle.report()
    assert landed is not None and landed.window == 0
    assert cycle.report() is None  # read once
    assert cycle.record() == {}  # nothing in the air to save


def test_with_delay_1_a_window_lands_and_steps_while_the_next_trains() -> None:
    cycle = _cycle(delay=1)
    first = _flight(0)
    cycle.launch(first)
    assert cycle.report() is None  # window 0's report: nothing landed yet
    assert cycle.record()["window"] == 0  # saved with the state: a restart resumes it
    # window 1: window 0's exchange lands during training, its step is taken, then window 1's
    # update goes up
    assert cycle.land(_forked) is LANDED
    cycle.take_in(_mean)
    _stepped(cycle)
    assert cycle.state is IDLE
    second = _flight(1)
    cycle.launch(second)
    assert cycle.state is IN_THE_AIR and cycle.air is second
    assert cycle.report() is first
    assert cycle.describe() == "window 1 in the air (done)"


def test_a_fork_with_delay_1_is_resynced_after_the_next_launch() -> None:
    cycle = _cycle(delay=1)
    cycle.launch(_flight(0, forked=True))
    assert cycle.land(_forked) is FORKED
    assert cycle.describe() == "window 0 forked"
    cycle.launch(_flight(1))  # window 1 encoded and sent before the resync rebuilds the model
    assert cycle.state is FORKED and cycle.air is not None
    assert cycle.describe() == "window 0 forked; window 1 in the air (done)"
    rebuilt: list[int] = []
    cycle.resync(lambda flight: rebuilt.append(flight.window))
    assert rebuilt == [0] and cycle.state is LANDED
    cycle.take_in(_mean)
    assert cycle.describe() == "mean held; window 1 in the air (done)"
    _stepped(cycle)
    assert cycle.state is IN_THE_AIR  # window 1's exchange still in the air
    landed = cycle.report()
    assert landed is not None and landed.window == 0


def test_a_fork_with_delay_0_is_resynced_then_steps() -> None:
    cycle = _cycle(delay=0)
    cycle.launch(_flight(0, forked=True))
    assert cycle.land(_forked) is FORKED
    cycle.resync(lambda _: None)
    cycle.take_in(_mean)
    _stepped(cycle)
    assert cycle.state is IDLE


def test_a_restart_resumes_the_exchange_in_the_air_or_steps_the_mean_it_saved() -> None:
    in_the_air = _cycle(delay=1)
    in_the_air.replayed()  # the saved state holds no mean
    assert in_the_air.state is IDLE
    in_the_air.resume(_flight(4))
    assert in_the_air.state is IN_THE_AIR
    assert in_the_air.land(_forked) is LANDED
    held = _cycle(delay=1)
    held.outer.receive(MEAN, 3)  # what loading a state saved after a last landing leaves
    held.replayed()
    assert held.state is HELD
    with pytest.raises(IllegalTransition, match="cannot resume the exchange while it is held"):
        held.resume(_flight(4))
    _stepped(held)
    assert held.state is IDLE


def test_a_replay_holds_what_the_history_left() -> None:
    cycle = _cycle(delay=1)
    cycle.launch(_flight(2))
    cycle.land(_forked)
    cycle.take_in(_mean)  # a peer that falls behind lands first, holding the mean
    cycle.replayed()  # the replay stepped with it and holds its last window's
    assert cycle.state is HELD
    cycle.outer.next_weights(ORIGIN)  # a replay that ends holding nothing
    cycle.replayed()
    assert cycle.state is IDLE


LEGAL = {
    "launch": {IDLE, FORKED},
    "resume": {IDLE},
    "land": {IN_THE_AIR},
    "resync": {FORKED},
    "take_in": {LANDED},
    "step": {HELD},
    "replayed": {IDLE, HELD},
    "report": {IDLE, IN_THE_AIR},
}
"""Where each transition may start (the module docstring of `miner.exchange_cycle`)."""

CALLS: dict[str, Callable[[ExchangeCycle], object]] = {
    "launch": lambda c: c.launch(_flight(9)),
    "resume": lambda c: c.resume(_flight(9)),
    "land": lambda c: c.land(_forked),
    "resync": lambda c: c.resync(lambda _: None),
    "take_in": lambda c: c.take_in(_mean),
    "step": lambda c: c.step(ORIGIN),
    "replayed": lambda c: c.replayed(),
    "report": lambda c: c.report(),
}


def _in(state: ExchangeState) -> ExchangeCycle:
    """A cycle brought to `state` by legal transitions (nothing in the air but for
    ``in the air``)."""
    cycle = _cycle()
    if state is IDLE:
        return cycle
    cycle.launch(_flight(0, forked=state is FORKED))
    if state is not IN_THE_AIR:
        cycle.land(_forked)
    if state is HELD:
        cycle.take_in(_mean)
    assert cycle.state is state
    return cycle


@pytest.mark.parametrize("state", list(ExchangeState))
@pytest.mark.parametrize("transition", list(LEGAL))
def test_a_transition_from_a_state_it_may_not_start_from_is_refused(
    state: ExchangeState, transition: str
) -> None:
    cycle = _in(state)
    if state in LEGAL[transition]:
        CALLS[transition](cycle)  # goes through
        return
    with pytest.raises(IllegalTransition, match=f"while it is {state}"):
        CALLS[transition](cycle)
    assert cycle.state is state
    assert cycle.outer.holding == (state is HELD)


def test_one_exchange_in_the_air_at_a_time() -> None:
    cycle = _cycle(delay=1)
    cycle.launch(_flight(0, forked=True))
    cycle.land(_forked)
    cycle.launch(_flight(1))
    with pytest.raises(IllegalTransition, match="window 1's is in the air"):
        cycle.launch(_flight(2))
    cycle.resync(lambda _: None)
    cycle.take_in(_mean)
    with pytest.raises(IllegalTransition, match="in the air"):
        cycle.replayed()  # a mean held with window 1 still up: no replay until it lands


def _paused_flight(steps: list[FlightStep]) -> tuple[Flight, list[threading.Event]]:
    """A background flight that enters `steps` in turn, each once the test lets it go on (not
    started: `Flight.start`, or the cycle's launch)."""
    go = [threading.Event() for _ in range(len(steps) + 1)]

    def work(enter: Enter) -> Exchanged:
        go[0].wait(10)
        for step, event in zip(steps, go[1:], strict=True):
            enter(step)
            event.wait(10)
        return Exchanged(0, 0.0, {}, Agreement({}, None, False, "test"))

    return Flight(5, "start", None, work, background=True), go


def test_a_flight_says_which_step_it_is_at_while_it_runs() -> None:
    later = list(FlightStep)[1:5]  # after uploading, up to agreeing
    flight, go = _paused_flight(later)
    flight.start()
    seen = [flight.step]
    for event, step in zip(go, later, strict=False):
        event.set()
        while flight.step is not step:
            threading.Event().wait(0.001)
        seen.append(flight.step)
    go[-1].set()
    assert flight.result() is not None
    seen.append(flight.step)
    assert [str(s) for s in seen] == [
        "uploading", "waiting for the gather block", "gathering", "waiting for the manifest",
        "agreeing", "done",
    ]  # fmt: skip
    inline = _flight(0)
    inline.start()
    assert inline.step is FlightStep.DONE  # ran inline
    assert Flight(0, "start", None, None, background=True).step is FlightStep.DONE  # no work


def test_a_flight_only_goes_forward_and_a_failed_one_says_so() -> None:
    back = [FlightStep.GATHERING, FlightStep.WAITING_FOR_GATHER_BLOCK]
    flight, go = _paused_flight(back)
    flight.start()
    for event in go:
        event.set()
    with pytest.raises(IllegalTransition, match="from gathering to waiting for the gather block"):
        flight.result()
    assert flight.step is FlightStep.FAILED
    again, go = _paused_flight([FlightStep.UPLOADING])  # where every flight starts
    again.start()
    for event in go:
        event.set()
    with pytest.raises(IllegalTransition):
        again.result()


def test_the_metrics_serve_the_state_and_step_as_they_are_when_scraped() -> None:
    metrics, cycle = PeerMetrics(60.0), _cycle(delay=1)
    metrics.watch(cycle)

    def now() -> tuple[set[ExchangeState], set[FlightStep]]:
        r = metrics.registry
        states = {s for s in ExchangeState if r.get_sample_value(
            "tessera_miner_exchange_state", {"state": s.value}) == 1}  # fmt: skip
        steps = {s for s in FlightStep if r.get_sample_value(
            "tessera_miner_exchange_step", {"step": s.value}) == 1}  # fmt: skip
        return states, steps

    assert now() == ({IDLE}, set())
    flight, go = _paused_flight([FlightStep.GATHERING])
    cycle.launch(flight)
    assert now() == ({IN_THE_AIR}, {FlightStep.UPLOADING})
    go[0].set()
    while flight.step is not FlightStep.GATHERING:
        threading.Event().wait(0.001)
    assert now() == ({IN_THE_AIR}, {FlightStep.GATHERING})
    go[1].set()
    cycle.land(_forked)
    assert now() == ({LANDED}, set())


def test_an_inline_exchange_reads_in_the_air_at_its_step_while_it_runs() -> None:
    """With ``delay = 0`` the exchange runs on the peer's own thread: the cycle starts it only
    once it holds it as in the air, so its state and step (what the window's log line and the
    metrics read) say where it is while it runs, not idle."""
    cycle = _cycle(delay=0)
    seen: list[tuple[ExchangeState, FlightStep | None]] = []

    def work(enter: Enter) -> Exchanged:
        seen.append((cycle.state, cycle.step_in_the_air))
        enter(FlightStep.GATHERING)
        seen.append((cycle.state, cycle.step_in_the_air))
        return Exchanged(0, 0.0, {}, Agreement({}, None, False, "test"))

    cycle.launch(Flight(0, "start", None, work, background=False))
    assert seen == [(IN_THE_AIR, FlightStep.UPLOADING), (IN_THE_AIR, FlightStep.GATHERING)]
    assert cycle.step_in_the_air is FlightStep.DONE


def test_a_flight_starts_once_and_is_read_only_once_started() -> None:
    flight = _flight(3)
    with pytest.raises(IllegalTransition, match="window 3 has not started"):
        flight.result()
    assert not flight.done()
    flight.start()
    assert flight.done() and flight.result() is not None
    with pytest.raises(IllegalTransition, match="window 3 has started already"):
        flight.start()
