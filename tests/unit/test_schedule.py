"""The run's learning-rate schedules (`protocol.schedule`): the inner rate's warmup and cosine,
the outer rate bounded while the inner one is near its peak, computed without the platform's
`libm` (every node must take the same outer step), and the outer step that uses it."""

from __future__ import annotations

import math

import pytest
import torch

from codec.spec import ModelSpec
from node.strategy import make_strategy
from protocol import schedule
from protocol.runconfig import RunConfig
from protocol.schedule import learning_rate, outer_alpha


def _run(alpha_at_peak: float | None = None) -> RunConfig:
    return RunConfig.preset(
        "tiny",
        inner_steps=10,
        optimizer={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 20},
        outer={"total_windows": 40, "alpha": 2.0, "alpha_at_peak": alpha_at_peak},
    )


def test_the_inner_rate_warms_up_linearly_then_follows_the_cosine() -> None:
    run = _run()
    assert learning_rate(run, 0) == pytest.approx(3e-3 / 20, rel=1e-15)
    assert learning_rate(run, 19) == pytest.approx(3e-3, rel=1e-15)
    for step, progress in ((20, 0.0), (115, 0.25), (210, 0.5), (305, 0.75), (400, 1.0), (500, 1.0)):
        expected = 3e-4 + 0.5 * (3e-3 - 3e-4) * (1 + math.cos(math.pi * progress))
        assert learning_rate(run, step) == pytest.approx(expected, rel=1e-14), step


def test_without_alpha_at_peak_every_window_steps_at_alpha() -> None:
    run = _run()
    assert {outer_alpha(run, w) for w in range(45)} == {2.0}


def test_the_outer_rate_times_the_inner_rate_stays_under_the_bound() -> None:
    """In warmup and late in the cosine the outer rate is `alpha`; in between, where a window's
    inner steps run near the peak, it is lowered so that alpha_w * mean lr <= alpha_at_peak * lr,
    and it reaches `alpha_at_peak` itself for the first windows at the peak."""
    run = _run(alpha_at_peak=1.4)
    rates = [outer_alpha(run, w) for w in range(40)]
    assert rates[0] == 2.0  # warmup: inner rates far below the peak
    assert rates[2] == pytest.approx(1.4, abs=0.01)  # the first window at the peak
    assert rates[-1] == 2.0  # the cosine's tail
    assert all(1.4 <= a <= 2.0 for a in rates)
    for w, a in enumerate(rates):
        mean = sum(learning_rate(run, w * 10 + i) for i in range(10)) / 10
        assert a * mean <= 1.4 * 3e-3 * (1 + 1e-12) or a == 2.0, w
    assert rates[2:17] == sorted(rates[2:17])  # rising back as the inner rate decays


def test_an_alpha_at_peak_of_alpha_or_more_changes_nothing() -> None:
    run = _run(alpha_at_peak=2.0)
    assert {outer_alpha(run, w) for w in range(40)} == {2.0}


def test_the_outer_rate_does_not_depend_on_the_platforms_cosine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two machines' `libm` may round a cosine differently in the last bit; the outer rate is part
    of the consensus, so it must not call one."""
    run = _run(alpha_at_peak=1.4)
    before = [outer_alpha(run, w) for w in range(40)]
    monkeypatch.setattr(math, "cos", lambda x: 0.123)
    monkeypatch.setattr(schedule.math, "cos", lambda x: 0.123)
    assert [outer_alpha(run, w) for w in range(40)] == before


SHAPES = {"weight": (8, 64), "bias": (64,)}


class _Params(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for name, shape in SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape)))


@pytest.mark.parametrize("delay", [0, 1])
def test_the_outer_step_applies_a_windows_mean_at_its_own_rate(delay: int) -> None:
    """A constant inner rate (no warmup, min_lr = lr): every window is at the peak, so each mean
    moves the weights by exactly alpha_at_peak times itself, held over a window with delay 1."""
    run = RunConfig.preset(
        "tiny",
        optimizer={"lr": 1e-3, "min_lr": 1e-3, "warmup_steps": 0},
        outer={"total_windows": 8, "alpha": 2.0, "alpha_at_peak": 0.5, "delay": delay},
    )
    model = _Params()
    strategy = make_strategy(run, ModelSpec.from_module(model))
    means = [{n: torch.full(s, float(w + 1)) for n, s in SHAPES.items()} for w in range(3)]
    for w, mean in enumerate(means):
        strategy.outer.step(model, mean, w)
    applied = means[: 3 - delay]
    expected = -0.5 * sum(float(w + 1) for w in range(len(applied)))
    for p in model.parameters():
        assert torch.equal(p.detach(), torch.full(p.shape, expected))
