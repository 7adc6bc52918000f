"""The most memory a call allocates: a hostile input's cost measured in bytes, not seconds."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable


def peak_allocation(call: Callable[[], object]) -> int:
    """Bytes allocated at the peak of `call()` above what was live before it; whatever `call`
    raises propagates once the measurement is stopped."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        call()
        return tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
