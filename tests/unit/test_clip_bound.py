"""The outer step's clip bound and divisor against crowds (docs/consensus.md, "What the bound is"):
half the applied set at the value cap cannot lift the bound above the honest norms, for even and
odd set sizes, and null updates do not dilute the honest step."""

from __future__ import annotations

import math

import pytest
import torch

from codec.aggregate import aggregate, clip_bound, clip_factors, mean_divisor, update_norm
from codec.compress import SparseTensor, densify
from codec.spec import ModelSpec
from node.model.llama import build_model
from node.strategy import make_strategy
from protocol.runconfig import RunConfig
from tests.support.directions import along
from validator.checks import norm_outliers

RUN = RunConfig.preset("tiny", name="clip-bound", inner_steps=2)
SPEC = ModelSpec.from_module(build_model(RUN.model, RUN.seed))


def _update(seed: int, direction: dict[str, torch.Tensor], sign: float = 1.0) -> list[SparseTensor]:
    """A compressed update along `direction` (times `sign`) plus its own small noise."""
    return along(SPEC, RUN.codec, seed, direction, sign)


def _at_value_cap(update: list[SparseTensor]) -> list[SparseTensor]:
    """The same pieces scaled so that each one's largest decoded value is just under the
    decoder's cap (the largest update the decoder admits)."""
    cap = RUN.codec.max_abs_value * (1 - 1e-4)
    return [
        SparseTensor(
            s.name, s.shape, s.groups, s.codebook * (cap / float(densify(s, RUN.codec).abs().max()))
        )
        for s in update
    ]


def _null(update: list[SparseTensor]) -> list[SparseTensor]:
    return [SparseTensor(s.name, s.shape, s.groups, s.codebook * 0.0) for s in update]


def _norm(tensors: dict[str, torch.Tensor]) -> float:
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors.values()))


@pytest.fixture(scope="module")
def direction() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {t.name: 1e-3 * torch.randn(t.shape, generator=gen) for t in SPEC.tensors}


def test_the_bound_is_the_lower_median_and_nulls_count_nothing() -> None:
    assert clip_bound([]) == 0.0 and clip_factors([]) == [] and mean_divisor([]) == 0.0
    assert clip_bound([5.0]) == 5.0
    assert clip_bound([1.0, 2.0, 4.0]) == 2.0
    assert clip_bound([1.0, 3.0, 5.0, 8.0]) == 3.0  # even: the lower of the two middle norms
    assert clip_factors([1.0, 3.0, 5.0, 8.0]) == [1.0, 1.0, 0.6, 0.375]
    assert mean_divisor([1.0, 3.0, 5.0, 8.0]) == pytest.approx(1 / 3 + 3)
    assert mean_divisor([0.0, 0.0, 2.0, 2.0, 2.0]) == 3.0  # two nulls, three at the bound
    assert mean_divisor([0.0, 0.0, 0.0]) == 0.0


@pytest.mark.parametrize("n", [4, 5, 6, 7])
def test_half_the_set_at_the_value_cap_moves_the_model_no_further_than_an_honest_update(
    n: int, direction: dict[str, torch.Tensor]
) -> None:
    """``n // 2`` updates at the value cap against the honest direction (exactly half for even
    ``n``): the bound stays at or below the largest honest norm, so the mean does too."""
    sybils = n // 2
    honest = {u: _update(u, direction) for u in range(n - sybils)}
    crowd = {100 + i: _at_value_cap(_update(100 + i, direction, -1.0)) for i in range(sybils)}
    largest_honest = max(update_norm(u) for u in honest.values())
    assert min(update_norm(u) for u in crowd.values()) > 100 * largest_honest
    norms = [update_norm(u) for u in {**honest, **crowd}.values()]
    assert clip_bound(norms) <= largest_honest

    mean = make_strategy(RUN, SPEC).aggregator.mean({**honest, **crowd})
    assert _norm(mean) <= largest_honest * (1 + 1e-6)
    again = aggregate({**honest, **crowd}, SPEC, RUN.codec, clip_to_median=True)
    assert all(torch.equal(mean[t], again[t]) for t in mean)  # one rule, both entry points


@pytest.mark.parametrize(("honest_count", "nulls"), [(3, 2), (4, 3), (4, 1)])
def test_null_updates_do_not_dilute_the_honest_step(
    honest_count: int, nulls: int, direction: dict[str, torch.Tensor]
) -> None:
    honest = {u: _update(u, direction) for u in range(honest_count)}
    empty = {50 + i: _null(_update(50 + i, direction)) for i in range(nulls)}
    strategy = make_strategy(RUN, SPEC)
    alone = _norm(strategy.aggregator.mean(honest))
    with_nulls = _norm(strategy.aggregator.mean({**honest, **empty}))
    # the honest norms differ by a few per cent, so the bound (an honest norm) moves a little;
    # dividing by the count of updates instead would scale the step by honest / (honest + nulls)
    assert with_nulls == pytest.approx(alone, rel=0.03)
    assert honest_count / (honest_count + nulls) < 0.81


@pytest.mark.parametrize("n", [4, 5])
def test_the_leads_norm_verdict_refuses_half_the_set_at_the_value_cap(
    n: int, direction: dict[str, torch.Tensor]
) -> None:
    sybils = n // 2
    norms = {u: update_norm(_update(u, direction)) for u in range(n - sybils)}
    cap = {
        100 + i: update_norm(_at_value_cap(_update(100 + i, direction, -1.0)))
        for i in range(sybils)
    }
    everyone = {**norms, **cap}
    outliers = norm_outliers(everyone, list(everyone.values()), ratio=10.0)
    assert sorted(outliers) == sorted(cap)
