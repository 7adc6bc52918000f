"""A chain handle that rides out outages: transient failures are retried with backoff and jitter.

A node must keep going when the chain endpoint blips; `ChainUnavailable` (network, node down,
locked database) is retried up to `attempts` times with exponentially growing, fully jittered
waits, then raised. Every other error (not registered, invalid weights, ...) propagates at once.
Calls are made one at a time (a lock around each attempt): a peer's exchange thread
(`miner.flight`) and its training thread share one client, which may not be thread-safe.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from protocol.chain.base import Chain
from protocol.chain.errors import ChainUnavailable

log = logging.getLogger(f"tessera.{__name__}")


class ResilientChain:
    """Wraps a `Chain`; every method call retries `ChainUnavailable`."""

    def __init__(
        self, inner: Chain, attempts: int = 8, base_delay: float = 0.5, max_delay: float = 15.0
    ) -> None:
        self._inner, self._attempts = inner, attempts
        self._base, self._max = base_delay, max_delay
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._retry(lambda: attr(*args, **kwargs), name)

        return call

    def _retry(self, fn: Callable[[], Any], what: str) -> Any:
        for attempt in range(1, self._attempts + 1):
            try:
                with self._lock:
                    return fn()
            except ChainUnavailable as exc:
                if attempt == self._attempts:
                    raise
                wait = random.uniform(0, min(self._max, self._base * 2 ** (attempt - 1)))
                log.warning("chain %s failed (%s); retry %d in %.1fs", what, exc, attempt, wait)
                time.sleep(wait)
        raise AssertionError("unreachable")


def resilient(chain: Chain) -> Chain:
    """`chain` with retries, typed as a `Chain` for the code that uses it."""
    return cast(Chain, ResilientChain(chain))
