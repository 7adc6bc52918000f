"""How long the lead keeps for publishing its decision after the admission probes
(`validator.admission.publish_reserve`): twice what publishing took last time, else an estimate
from the bytes it will put and the rate its fetch reached (then never more than half the time
left); at least a floor for a probe that overruns, either way."""

from __future__ import annotations

import pytest

from node.runtime.preflight import write_rate
from node.window.consensus import MIN_PUBLISH_RESERVE_S
from protocol.credentials import WriteCredentials
from protocol.stores import open_store
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


def test_a_first_publish_is_sized_by_our_buckets_write_rate_not_the_fetch() -> None:
    # at launch the fetch took 3.1 s for 3 updates of 70 kB (decoding them and waiting included):
    # at that rate the reserve was half the 10.9 s left, and two honest updates went unprobed
    applied = 3 * 70_000
    slow_fetch = publish_reserve(10.9, None, applied, applied, 3.1)
    assert slow_fetch == pytest.approx(10.9 / 2)
    measured = publish_reserve(10.9, None, applied, applied, 3.1, write_rate=50e6)
    assert measured == MIN_PUBLISH_RESERVE_S  # 4 ms of transfer: the floor
    big = publish_reserve(100.0, None, 10**9, 10**9, 1.0, write_rate=50e6)
    assert big == pytest.approx(2 * 10**9 / 50e6)  # 40 s, twice the transfer
    assert publish_reserve(10.9, None, 10**9, 10**9, 1.0, write_rate=1e6) == pytest.approx(5.45)


def test_our_buckets_write_rate_is_measured_with_a_real_put_and_leaves_nothing(
    s3_url: str, s3_credentials: WriteCredentials
) -> None:
    store = open_store(s3_url, s3_credentials)
    rate = write_rate(store, size=1 << 20)
    assert rate is not None and rate > 0
    assert store.list("tessera-probe/", limit=10) == []
    refused = open_store(s3_url.replace("tessera-test", "no-such-bucket"), s3_credentials)
    assert write_rate(refused, size=1024) is None
