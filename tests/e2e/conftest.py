"""The end-to-end tests in an order that keeps two pytest-xdist workers equally long busy.

`scripts/test.sh` runs them on two workers with ``--dist worksteal``, which hands the first half
of the collected tests to one worker and the second half to the other, each in order, and later
moves the tail of one queue to an idle worker (never the test running, nor the one after it).
Their wall time follows the simulated chain's clock, not the CPU, so which worker gets which test
decides when the phase ends: in file order one worker took both simulations and the validator
test, the other stopped early, and the phase took 11 min 28 s. Listed here
(durations from a quiet suite run): the two simulations on one worker, one after the other (never
both at once on two cores), then the two-rank peer, about 500 s; the rest on the other worker,
about 440 s. (Each half must hold four tests: the split is by count. With the two-rank peer in the
second half, the first half's fourth test was the two-peer test; the other worker took it and
the live view's test, whose session fixture then waited 93 s for the simulation's lock.)
"""

from __future__ import annotations

import pytest

BALANCED = (
    # the first half: the simulations, then the two-rank peer
    "test_sim.py::test_simulation_with_ordinary_faults_on_an_s3_server",  # 277 s
    "test_sim.py::test_simulation_with_every_adversary",  # 160 s
    # reads the run above from the same worker, at once
    "test_sim.py::test_prometheus_scrapes_the_simulation_and_every_dashboard_query_has_series",
    "test_multigpu.py::test_two_ranks_end_where_one_rank_ends",  # 65 s
    # the second half
    "test_peers_e2e.py::test_two_peers_stay_identical_learn_and_resume_after_kill",  # 156 s
    "test_validator_e2e.py::test_validator_weights_honest_peers_only",  # 97 s
    "test_diloco_e2e.py::test_diloco_peers_validator_and_a_latecomer_stay_identical",  # 97 s
    "test_fsdp.py::test_fsdp2_peer_ends_where_one_rank_ends_and_resumes_after_kill",  # 85 s
)


def _rank(item: pytest.Item) -> int:
    name = item.nodeid.rsplit("/", 1)[-1]
    return BALANCED.index(name) if name in BALANCED else len(BALANCED)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: the tests not listed keep their order, after these
