"""Retry loop with capped exponential backoff and full jitter.

botocore already retries single HTTP attempts; this loop sits around whole operations (a request
plus reading its body, one part of a multipart transfer) so that a connection dropped halfway
through a body, which botocore cannot replay, is retried too.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from protocol.stores.errors import StoreUnavailable, sanitize

__all__ = ["RetryPolicy", "call_with_retries"]

T = TypeVar("T")
log = logging.getLogger(f"tessera.{__name__}")


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """`attempts` tries in total; the wait before retry n (1-based) is uniform in
    [0, min(max_delay, base_delay * 2**(n-1))] ("full jitter")."""

    attempts: int = 3
    base_delay: float = 0.25
    max_delay: float = 8.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if self.base_delay < 0 or self.max_delay < 0:
            raise ValueError("delays must be >= 0")

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        doubling = 2 ** min(max(retry - 1, 0), 60)  # capped: a long outage counts many retries
        ceiling = min(self.max_delay, self.base_delay * doubling)
        return (rng or random).uniform(0.0, ceiling)


def call_with_retries(
    fn: Callable[[], T],
    *,
    policy: RetryPolicy,
    is_transient: Callable[[BaseException], bool],
    what: str,
    on_retry: Callable[[BaseException], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> T:
    """Run `fn`, retrying transient failures; raise `StoreUnavailable` when they persist.

    Non-transient exceptions propagate unchanged on the first occurrence. `should_stop` lets a
    caller cut the loop short (e.g. a sibling part already failed).
    """
    for attempt in range(1, policy.attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            last = exc
            if attempt == policy.attempts or (should_stop is not None and should_stop()):
                break
            if on_retry is not None:
                on_retry(exc)
            wait = policy.delay(attempt)
            log.warning(
                "%s: attempt %d/%d failed (%s); retrying in %.2fs",
                what,
                attempt,
                policy.attempts,
                sanitize(type(exc).__name__),
                wait,
            )
            time.sleep(wait)
    raise StoreUnavailable(
        f"{what} failed after {attempt} attempt(s): {type(last).__name__}: {sanitize(last)}"
    ) from last
