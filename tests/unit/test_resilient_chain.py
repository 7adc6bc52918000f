"""A chain outage is ridden out with retries under one deadline; other errors are not retried."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import cast

import pytest
from substrateinterface import Keypair

from node.runtime import resilient_chain
from node.runtime.resilient_chain import ResilientChain
from protocol.chain.base import Chain
from protocol.chain.errors import BlockNotFinal, ChainUnavailable, NotRegistered
from protocol.chain.local import LocalChain
from protocol.chain.local_db import LocalChainDB, create_local_chain
from protocol.runconfig import RunConfig
from protocol.stores import open_store
from tests.support.chain_clock import Clock
from validator.loop import Validator
from validator.state import OUTAGES_FILE


class Flaky:
    """A real-shaped stand-in for a chain endpoint that is down for its first `down` calls."""

    def __init__(self, down: int) -> None:
        self.down, self.calls = down, 0

    def block(self) -> int:
        self.calls += 1
        if self.calls <= self.down:
            raise ChainUnavailable("connection refused")
        return 42

    def uid_of(self, hotkey: str) -> int:
        self.calls += 1
        raise NotRegistered(hotkey, 1, "register it")


def test_outage_is_retried_then_recovers() -> None:
    flaky = Flaky(down=3)
    chain = ResilientChain(flaky, base_delay=0.001)  # type: ignore[arg-type]
    assert chain.block() == 42
    assert flaky.calls == 4


def test_a_long_outage_is_ridden_out_under_one_deadline() -> None:
    """Many failures in a row (more than any fixed count of attempts) within the deadline."""
    flaky = Flaky(down=200)
    chain = ResilientChain(flaky, give_up_after_s=30.0, base_delay=0.001, max_delay=0.002)  # type: ignore[arg-type]
    assert chain.block() == 42
    assert flaky.calls == 201


class StoppedClock:
    """The retry loop's clock: time moves only when the loop sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return 1_000_000.0 + self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_persistent_outage_raises_once_the_deadline_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = StoppedClock()
    monkeypatch.setattr(resilient_chain, "time", clock)
    flaky = Flaky(down=10**9)
    chain = ResilientChain(flaky, give_up_after_s=0.3, base_delay=0.01, max_delay=0.02)  # type: ignore[arg-type]
    with pytest.raises(ChainUnavailable, match=r"kept failing for 0 s .*--chain"):
        chain.block()
    assert 0.3 - 0.02 < clock.now <= 0.3  # waits up to the deadline, never past it
    assert flaky.calls > 3


def test_the_spans_in_which_the_chain_failed_are_remembered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two outages a minute apart are two spans; a call that succeeds leaves no mark, and a
    window that ran wholly between or after them saw no outage."""
    clock = StoppedClock()
    monkeypatch.setattr(resilient_chain, "time", clock)
    flaky = Flaky(down=5)
    chain = ResilientChain(flaky, base_delay=0.5, max_delay=1.0)  # type: ignore[arg-type]
    assert chain.block() == 42
    first_end = clock.time()
    clock.now += 60.0
    assert chain.block() == 42  # up: nothing recorded
    flaky.calls, flaky.down = 0, 3
    second = clock.time()
    assert chain.block() == 42
    start, spans = 1_000_000.0, chain.outages
    assert spans.overlaps(start - 5, start)
    assert not spans.overlaps(first_end + 1, second - 1)
    assert spans.overlaps(second, second + 100)
    assert not spans.overlaps(clock.time() + 1, clock.time() + 100)


def test_only_an_outage_of_some_seconds_counts_as_the_chain_down() -> None:
    """Failures less than `join_s` apart are one outage, from the first to the last; a blip that
    one retry rode out is not the chain down (`MIN_OUTAGE_S`), and a chain that keeps no record
    was never down."""
    outages = resilient_chain.Outages(join_s=8.0)
    for t in (100.0, 103.0, 106.5):  # one outage of 6.5 s
        outages.failed_at(t)
    outages.failed_at(200.0)  # a blip, 93.5 s later
    chain = ResilientChain(Flaky(down=0))  # type: ignore[arg-type]
    chain.outages = outages
    down = resilient_chain.chain_was_down
    assert down(chain, 90.0, 101.0) and down(chain, 104.0, 105.0)  # type: ignore[arg-type]
    assert not down(chain, 107.0, 199.0)  # type: ignore[arg-type]
    assert not down(chain, 150.0, 250.0)  # type: ignore[arg-type]  # the blip alone
    assert outages.overlaps(150.0, 250.0)  # it was recorded all the same
    assert not down(Flaky(down=0), 0.0, 2e9)  # type: ignore[arg-type]


def test_a_block_not_final_yet_is_asked_again() -> None:
    class Finalising:
        calls = 0

        def snapshot(self, block: int) -> str:
            self.calls += 1
            if self.calls <= 2:
                raise BlockNotFinal("not final", block=block, latest_final=block - 1)
            return "pinned"

    inner = Finalising()
    chain = ResilientChain(inner, base_delay=0.001)  # type: ignore[arg-type]
    assert chain.snapshot(7) == "pinned" and inner.calls == 3


def test_other_errors_are_not_retried() -> None:
    flaky = Flaky(down=0)
    chain = ResilientChain(flaky, base_delay=0.001)  # type: ignore[arg-type]
    with pytest.raises(NotRegistered):
        chain.uid_of("5Grw")
    assert flaky.calls == 1


class Unshared:
    """An endpoint client that must not be entered by two threads at once (a websocket)."""

    def __init__(self) -> None:
        self.inside, self.overlaps = 0, 0

    def block(self) -> int:
        self.inside += 1
        if self.inside > 1:
            self.overlaps += 1
        time.sleep(0.002)
        self.inside -= 1
        return 7


def test_calls_from_two_threads_reach_the_client_one_at_a_time() -> None:
    """A peer's exchange thread and its training thread share one chain client."""
    client = Unshared()
    chain = ResilientChain(client)  # type: ignore[arg-type]
    threads = [
        threading.Thread(target=lambda: [chain.block() for _ in range(40)]) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert client.overlaps == 0


def test_an_outage_of_the_local_chain_is_seen_by_every_handle_and_ridden_out(tmp_path) -> None:  # noqa: ANN001
    """`LocalChainDB.set_outage` (what `tessera sim --faults chain-stall` does): every other
    handle of the chain file fails every call as an unreachable endpoint does, blocks go on
    meanwhile, and a resilient handle's call returns once the outage ends."""
    from protocol.chain.local import LocalChain
    from protocol.chain.local_db import LocalChainDB, create_local_chain

    create_local_chain(tmp_path / "chain.db", 1, block_time=0.1)
    node = LocalChain(tmp_path / "chain.db", 1)
    before, asked = node.block(), time.time()
    LocalChainDB(tmp_path / "chain.db").set_outage(1.0)
    for call in (node.block, node.metagraph, node.read_all_commitments):
        with pytest.raises(ChainUnavailable, match="down"):
            call()
    after = ResilientChain(node, base_delay=0.05, max_delay=0.1).block()
    assert time.time() >= asked + 1.0  # it answered only once the outage was over
    assert after >= before + 10  # the chain went on producing blocks meanwhile
    assert node.metagraph().neurons == ()


def test_a_restarted_validator_still_knows_when_the_chain_was_down(tmp_path: Path) -> None:
    """An outage long enough to stop the validator (every call gives up after ten minutes) is
    still on record when it restarts and catches up on the windows the outage spanned: it keeps
    the record beside its state. A record it cannot read is no record, never a crash."""
    clock = Clock(time.time(), 12.0)
    create_local_chain(tmp_path / "chain.db", 1, block_time=12.0, clock=clock)
    admin = LocalChainDB(tmp_path / "chain.db", clock=clock)
    key = Keypair.create_from_uri("//outages")
    admin.register(1, key.ss58_address, validator=True, stake=100.0)
    run = RunConfig.preset("tiny", name="outages")
    store = open_store(f"file://{tmp_path}?bucket=validator")

    def start() -> ResilientChain:
        chain = ResilientChain(LocalChain(tmp_path / "chain.db", 1, clock=clock))
        Validator(run, key, cast(Chain, chain), store, tmp_path / "state")
        return chain

    first = start()
    for t in (1000.0, 1004.0, 1009.0):  # calls failing for 9 s
        first.outages.failed_at(t)
    down = resilient_chain.chain_was_down
    assert down(start(), 1001.0, 1002.0)  # type: ignore[arg-type]
    (tmp_path / "state" / OUTAGES_FILE).write_text("[[1, ")
    assert not down(start(), 1001.0, 1002.0)  # type: ignore[arg-type]
    admin.close()
