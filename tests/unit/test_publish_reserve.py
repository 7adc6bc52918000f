"""How long the lead keeps for publishing its decision after the admission probes
(`validator.admission.publish_reserve`): twice what publishing took last time, else an estimate
from the bytes it will put and the rate its fetch reached (then never more than half the time
left); at least a floor for a probe that overruns, either way."""

from __future__ import annotations

import pytest

from node.window.consensus import MIN_PUBLISH_RESERVE_S
from validator.admission import publish_reserve


def test_after_a_publish_the_lead_keeps_twice_what_it_took() -> None:
    assert publish_reserve(20.0, 3.0, 10**6, 10**6, 1.0) == pytest.approx(6.0)
    assert publish_reserve(20.0, 30.0, 10**6, 10**6, 1.0) == pytest.approx(20.0)  # all of it


def test_a_quick_publish_still_keeps_the_floor_for_a_probe_that_overruns() -> None:
    # publishing took 0.1 s: 0.2 s kept let a loaded lead's last probe run past its last block
    assert publish_reserve(20.0, 0.1, 10**6, 10**6, 1.0) == MIN_PUBLISH_RESERVE_S
    assert publish_reserve(1.5, 0.1, 10**6, 10**6, 1.0) == pytest.approx(1.5)  # all that is left


def test_a_first_publish_keeps_twice_the_transfer_at_the_fetch_rate_not_half_the_window() -> None:
    # 16 updates of 70 kB fetched in 5 s; 7 of them applied: 2.2 s to put them at that rate
    fetched, applied, left = 16 * 70_000, 7 * 70_000, 25.0
    reserve = publish_reserve(left, None, applied, fetched, 5.0)
    assert reserve == pytest.approx(2 * applied * 5.0 / fetched)
    assert reserve < 0.5 * left / 2  # probes get most of the time that half the window kept


def test_a_first_publish_keeps_at_least_the_floor_for_its_requests() -> None:
    assert publish_reserve(25.0, None, 100, 10**9, 0.1) == MIN_PUBLISH_RESERVE_S


def test_slow_uploads_cannot_push_the_reserve_past_half_the_time_left() -> None:
    # a crowd dripping its bytes until the fetch budget: the rate looks tiny
    assert publish_reserve(25.0, None, 10**6, 10**6, 600.0) == pytest.approx(12.5)


def test_without_a_fetch_to_measure_the_lead_keeps_half() -> None:
    assert publish_reserve(25.0, None, 0, 0, 0.0) == pytest.approx(12.5)
    assert publish_reserve(25.0, None, 10**6, 10**6, 0.0) == pytest.approx(12.5)
