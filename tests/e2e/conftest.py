"""The end-to-end tests start longest first.

Each is marked ``slow(seconds=…)`` with about how long it runs on the two-core development machine
beside the other tests. `scripts/test.sh` hands them to its workers one at a time (``--dist load
--maxschedchunk 1``), so in this order the longest start at once and the short ones fill in
after them: the run ends about when the longest one does.
"""

from __future__ import annotations

import pytest


def _seconds(item: pytest.Item) -> float:
    slow = item.get_closest_marker("slow")
    return float(slow.kwargs.get("seconds", 0)) if slow is not None else 0.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_seconds, reverse=True)
