"""A validator's scores after a window's agreement are bounded by the run, not by how many
hotkeys registered: at most twice the gather size each window (`ValidatorConfig.max_scored` to
change it), the applied updates first, the others in turn by the window's draw, so a crowd of
registrations neither raises a validator's probes nor leaves any peer unscored for long."""

from __future__ import annotations

import random
from collections import Counter

from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.scoring import pick_scored, scored_after_agreement

RUN = RunConfig.preset("tiny")
WINDOWS = 300


def test_the_scored_count_per_window_is_the_runs_bound_whatever_the_registered_count() -> None:
    cap = ValidatorConfig().scored_per_window(RUN.gather_size)
    assert cap == 2 * RUN.gather_size
    for registered in (RUN.gather_size, 64, 256, 1024):
        uids = list(range(registered))
        scored: Counter[int] = Counter()
        for window in range(WINDOWS):
            draw = pick_scored(RUN.run_id, window, uids, 0, set(uids))
            applied = random.Random(window).sample(uids, RUN.gather_size)
            order = scored_after_agreement(draw, applied, (), cap)
            assert len(order) == min(registered, cap)
            assert order[: len(applied)] == [u for u in draw if u in set(applied)]
            scored.update(order)
        # every peer scored in turn: none far below its share (a few windows' worth at 1024)
        each = WINDOWS * min(registered, cap) / registered
        if each >= 15:
            assert min(scored[u] for u in uids) >= 0.25 * each, (registered, min(scored.values()))


def test_an_operator_may_score_every_update_or_fewer() -> None:
    draw = list(range(100))
    assert scored_after_agreement(
        draw, [5], (), ValidatorConfig(max_scored=0).scored_per_window(8)
    ) == [
        5,
        *[u for u in draw if u != 5],
    ]
    assert (
        len(
            scored_after_agreement(draw, [], (), ValidatorConfig(max_scored=3).scored_per_window(8))
        )
        == 3
    )


def test_an_applied_peer_without_earning_evidence_is_scored_before_earning_ones() -> None:
    """A loaded validator scores one or two updates a window: the first ones go to the applied
    peers whose pay waits for a first rating, not to an earning peer, which keeps its standing;
    every applied update still comes before the refused ones."""
    draw = [7, 1, 4, 0, 9, 3]
    applied, earning = [1, 0, 3], {1, 3, 9}
    order = scored_after_agreement(draw, applied, earning, 0)
    assert order == [0, 1, 3, 7, 4, 9]
    assert scored_after_agreement(draw, applied, earning, 1) == [0]
