"""A chain outage is ridden out with retries; other errors are not retried."""

from __future__ import annotations

import threading
import time

import pytest

from node.runtime.resilient_chain import ResilientChain
from protocol.chain.errors import ChainUnavailable, NotRegistered


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
    chain = ResilientChain(flaky, attempts=5, base_delay=0.001)  # type: ignore[arg-type]
    assert chain.block() == 42
    assert flaky.calls == 4


def test_persistent_outage_raises_after_the_last_attempt() -> None:
    flaky = Flaky(down=100)
    chain = ResilientChain(flaky, attempts=3, base_delay=0.001)  # type: ignore[arg-type]
    with pytest.raises(ChainUnavailable):
        chain.block()
    assert flaky.calls == 3


def test_other_errors_are_not_retried() -> None:
    flaky = Flaky(down=0)
    chain = ResilientChain(flaky, attempts=5, base_delay=0.001)  # type: ignore[arg-type]
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
