"""A chain handle that rides out outages: transient failures are retried under one deadline.

A node must keep going when the chain endpoint blips or goes down for minutes: `ChainUnavailable`
(network, node down, locked database) and `BlockNotFinal` (the block asked for is not final yet;
it soon will be) are retried with exponentially growing, fully jittered waits (the stores'
`RetryPolicy`, at most `max_delay` apart: a node notices a chain that came back within a few
seconds, a third of a block) until `give_up_after_s` has passed since the call began, then raised
with the time it tried. Every other error (not registered, invalid weights, a pruned block, ...)
propagates at once. Calls are made one at a time (a lock around each attempt): a peer's exchange
thread (`miner.flight`) and its training thread share one client, which may not be thread-safe.

Every failed attempt is remembered (`Outages`): a validator asks `chain_was_down` whether the
chain was down (calls failing for `MIN_OUTAGE_S` or more) while a window ran, and then holds no
lateness or absence against the peers (an outage delays every honest node's reads of the clock
and of the decision before it).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from node.runtime.atomic_files import write_json_atomic
from protocol.chain.base import Chain
from protocol.chain.errors import BlockNotFinal, ChainUnavailable
from protocol.stores.retry import RetryPolicy

log = logging.getLogger(f"tessera.{__name__}")

GIVE_UP_AFTER_S = 600.0
"""How long one call rides out an outage before it fails (ten minutes)."""


OUTAGES_KEPT = 64
"""How many separate outages a node remembers (the oldest are forgotten)."""
MIN_OUTAGE_S = 5.0
"""The shortest span of failed calls that counts as the chain being down (`chain_was_down`): a
blip that one retry rode out makes nobody late."""


class Outages:
    """The spans of wall-clock time (Unix seconds) in which chain calls failed: failures less
    than `join_s` apart are one outage. Kept in a file (`keep_in`), they outlive the process: a
    node that an outage stopped, restarted, still knows the chain was down in the windows it
    catches up on."""

    def __init__(self, join_s: float) -> None:
        self._join_s = join_s
        self._spans: deque[list[float]] = deque(maxlen=OUTAGES_KEPT)
        self._file: Path | None = None

    def keep_in(self, path: Path) -> None:
        """Add the spans kept in `path` (none if it is missing or unreadable) and keep every
        change there from now on."""
        try:
            kept = json.loads(path.read_text())
            spans = [[float(a), float(b)] for a, b in kept if math.isfinite(a + b) and a <= b]
        except (OSError, ValueError, TypeError):
            spans = []
        self._spans.extendleft(reversed(spans[-OUTAGES_KEPT:]))
        self._file = path

    def failed_at(self, when: float) -> None:
        if self._spans and when - self._spans[-1][1] <= self._join_s:
            self._spans[-1][1] = max(self._spans[-1][1], when)
        else:
            self._spans.append([when, when])
        if self._file is not None:
            try:
                write_json_atomic(self._file, list(self._spans))
            except OSError as exc:  # the record is a courtesy to the peers: never fatal
                log.warning("could not keep the chain's outages in %s: %s", self._file, exc)

    def overlaps(self, start: float, end: float, at_least_s: float = 0.0) -> bool:
        """Whether an outage of at least `at_least_s` (its first failure to its last) had a
        failure between `start` and `end`, or spans them."""
        return any(
            first <= end and last >= start and last - first >= at_least_s
            for first, last in self._spans
        )


class ResilientChain:
    """Wraps a `Chain`; every method call retries `ChainUnavailable` and `BlockNotFinal`."""

    def __init__(
        self,
        inner: Chain,
        give_up_after_s: float = GIVE_UP_AFTER_S,
        base_delay: float = 0.5,
        max_delay: float = 4.0,
    ) -> None:
        self._inner, self._give_up = inner, give_up_after_s
        self._waits = RetryPolicy(base_delay=base_delay, max_delay=max_delay)
        self._lock = threading.Lock()
        # failed attempts: a retry waits at most max_delay, so failures further apart are two
        self.outages = Outages(join_s=2 * max_delay)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._retry(lambda: attr(*args, **kwargs), name)

        return call

    def _retry(self, fn: Callable[[], Any], what: str) -> Any:
        begun = time.monotonic()
        attempt = 0
        while True:
            attempt += 1
            try:
                with self._lock:
                    return fn()
            except (ChainUnavailable, BlockNotFinal) as exc:
                if isinstance(exc, ChainUnavailable):
                    self.outages.failed_at(time.time())
                waited = time.monotonic() - begun
                wait = self._waits.delay(attempt)
                if waited + wait > self._give_up:
                    raise ChainUnavailable(
                        f"chain {what} kept failing for {waited:.0f} s ({exc}): check the chain "
                        "endpoint (--chain) and the network"
                    ) from exc
                log.warning("chain %s failed (%s); retry %d in %.1fs", what, exc, attempt, wait)
                time.sleep(wait)


def chain_was_down(chain: Chain, start: float, end: float) -> bool:
    """Whether `chain` (a `ResilientChain`; any other chain keeps no record) was down, its calls
    failing for `MIN_OUTAGE_S` or more, between the Unix times `start` and `end`."""
    return isinstance(chain, ResilientChain) and chain.outages.overlaps(start, end, MIN_OUTAGE_S)


def keep_outages(chain: Chain, path: Path) -> None:
    """Keep `chain`'s record of outages (a `ResilientChain`'s; any other keeps none) in `path`,
    with what an earlier run kept there."""
    if isinstance(chain, ResilientChain):
        chain.outages.keep_in(path)


def resilient(chain: Chain) -> Chain:
    """`chain` with retries, typed as a `Chain` for the code that uses it."""
    return cast(Chain, ResilientChain(chain))
