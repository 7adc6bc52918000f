"""`tessera bench train --tune`: every baseline over a grid, tagged with its family, and every
ratio taken against the best configuration of DDP and of the dense local methods."""

from __future__ import annotations

import pytest

from lab.bench.train.report import summarise, table_rows
from lab.bench.train.specs import parse_methods, tuned_strategies
from protocol.runconfig import RunConfig


def test_the_grid_covers_each_baseline_family() -> None:
    base = RunConfig.preset("tiny")
    methods = parse_methods(tuned_strategies(base), base)
    families: dict[str, list] = {}
    for m in methods:
        families.setdefault(m.family, []).append(m)
    assert set(families) == {"DDP", "dense local SGD", "DiLoCo", "sparseloco"}
    lrs = sorted(m.run.optimizer.lr for m in families["DDP"])
    assert len(lrs) == 4 and lrs[0] < base.optimizer.lr < lrs[-1]
    assert base.optimizer.lr == pytest.approx(lrs[1])
    assert lrs[1] < lrs[2] < lrs[3]  # DDP's best at tiny is between the run's rate and twice it
    sgd = families["dense local SGD"]
    assert {m.run.outer.optimizer for m in sgd} == {"sgd"} and len(
        {m.run.outer.alpha for m in sgd}
    ) == 3
    assert 1.0 in {m.run.outer.alpha for m in sgd}  # plain averaging is one of them
    # plain averaging also at higher inner rates, each with its own label, min_lr following
    averaging = sorted((m.run.optimizer.lr, m.label) for m in sgd if m.run.outer.alpha == 1.0)
    assert averaging[0][0] == pytest.approx(base.optimizer.lr)
    assert len(averaging) == 3 and len({label for _, label in averaging}) == 3
    assert all(lr > base.optimizer.lr for lr, _ in averaging[1:])
    assert all(m.run.optimizer.min_lr == pytest.approx(m.run.optimizer.lr / 10) for m in sgd)
    baselines = sgd + families["DiLoCo"]
    assert {m.run.outer.alpha_at_peak for m in baselines} == {None}  # a constant outer rate
    diloco = families["DiLoCo"]
    assert {m.run.outer.optimizer for m in diloco} == {"nesterov"}
    assert len({(m.run.outer.alpha, m.run.outer.momentum) for m in diloco}) == 4
    assert [m.run.codec for m in families["sparseloco"]] == [base.codec]
    mine = parse_methods(tuned_strategies(base, ["sparseloco:k=64", "demo"]), base)
    assert len(mine) == len(methods) + 1 and mine[:-2] == methods[:-1]  # the same grid
    assert mine[-2].run.codec.k == 64 and mine[-1].strategy == "demo"


def _row(label: str, strategy: str, family: str, loss: float, dense: bool = True) -> dict:
    return {"label": label, "strategy": strategy, "family": family, "dense": dense,
            "final_loss": loss, "bytes_per_window": 100.0 if dense else 2.0, "wall_s": 1.0}  # fmt: skip


def test_ratios_are_against_each_familys_best() -> None:
    rows = [
        _row("DDP lr 0.001", "ddp", "DDP", 5.3),
        _row("DDP lr 0.002", "ddp", "DDP", 5.1),
        _row("DDP lr 0.004", "ddp", "DDP", 5.2),
        _row("SGD 0.7", "diloco", "dense local SGD", 5.6),
        _row("SGD 1.0", "diloco", "dense local SGD", 5.5),
        _row("sparseloco", "sparseloco", "sparseloco", 5.61, dense=False),
    ]
    summary = summarise(rows, 400)
    assert summary["best_ddp"] == "DDP lr 0.002" and summary["best_dense"] == "SGD 1.0"
    assert summary["best_of_family"]["DDP"] == "DDP lr 0.002"
    sparse = rows[-1]
    assert sparse["vs_ddp"] == pytest.approx(5.61 / 5.1)
    assert sparse["vs_best_dense"] == pytest.approx(5.61 / 5.5)
    assert [r["best_in_family"] for r in rows] == [False, True, False, False, True, False]
    labels = [cells[0] for cells in table_rows(rows)]
    assert labels[1] == "DDP lr 0.002 (best)" and labels[-1] == "sparseloco"


def test_peak_sets_or_unsets_the_outer_rate_at_the_inner_peak() -> None:
    base = RunConfig.preset("tiny")
    plain, peaked, unset = parse_methods("sparseloco,sparseloco:peak=1,sparseloco:peak=none", base)
    assert plain.run.outer.alpha_at_peak == base.outer.alpha_at_peak
    assert peaked.run.outer.alpha_at_peak == 1.0 and unset.run.outer.alpha_at_peak is None
