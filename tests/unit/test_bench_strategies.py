"""`tessera bench train` with the seeds' strategies: their options map onto the run config, bad
ones are refused, and every strategy and bench variant trains through the real engine (replicas
encode with the consensus' state, the real wire both ways, one consensus step)."""

from __future__ import annotations

import math

import pytest
import torch

from codec.spec import ModelSpec
from lab.bench.train.engine import Setup, _strategy, heldout_set, run_local
from lab.bench.train.specs import SpecError, parse_methods
from lab.strategies.greedylore_variants import NowBasis
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy.greedylore import LowRankFormat
from protocol.runconfig import RunConfig

SMALL = {"hidden_size": 32, "intermediate_size": 64, "n_layers": 1, "n_heads": 2, "n_kv_heads": 1}


def _base(windows: int = 2, inner_steps: int = 2) -> RunConfig:
    return RunConfig.preset(
        "tiny", name="bench-strategies", model=SMALL, inner_steps=inner_steps,
        outer={"total_windows": windows},
    )  # fmt: skip


def test_options_map_onto_the_run_config() -> None:
    base = _base(windows=4, inner_steps=4)
    demo, mask, lore, sgd = parse_methods(
        "demo:bits=1,k=32,h=2,sparseloco-mask:shared=100,fresh=8,explore=0.5,"
        "greedylore:rank=4,tau=5,select=now,dtype=fp32,sparseloco:inner=sgd,lr=0.5",
        base,
    )
    assert (demo.run.codec.value_bits, demo.run.codec.k) == (1, 32)
    assert (demo.run.inner_steps, demo.run.outer.total_windows) == (2, 8)  # two steps a window
    assert (mask.run.mask.shared_k, mask.run.mask.fresh_k, mask.run.mask.explore) == (100, 8, 0.5)
    assert (lore.run.lowrank.rank, lore.run.lowrank.tau, lore.run.dense.dtype) == (4, 5, "fp32")
    assert lore.options["select"] == "now"
    assert (sgd.run.optimizer.name, sgd.run.optimizer.lr) == ("sgd", 0.5)
    for bad in ("demo:h=3", "greedylore:select=soon", "greedylore:basis=svd", "sparseloco-mask:k=4",
                "demo:bits=3", "diloco:rank=2"):  # fmt: skip
        with pytest.raises(SpecError):
            parse_methods(bad, base)


@pytest.mark.parametrize(
    "item",
    [
        "demo:h=1,inner=sgd,lr=0.3,beta=0.9,freeze=0,bits=1",
        "sparseloco-mask:shared=64,fresh=8",
        "greedylore:rank=2,tau=2",
        "greedylore:rank=2,tau=2,select=now",
        "greedylore:rank=2,tau=2,basis=random",
    ],
)
def test_every_seed_strategy_trains_through_the_engine(item: str) -> None:
    base = _base(windows=2)
    (method,) = parse_methods(item, base)
    _, dataset = open_run_dataset(base)
    setup = Setup(base, dataset, (0, 1), 2, heldout_set(dataset, base.run_id, 8), base.run_id)
    curve = run_local(method, setup, lambda w, loss: None)
    assert len(curve.loss) == 2 and all(math.isfinite(x) for x in curve.loss)
    assert curve.loss[-1] < curve.initial_loss  # it trained
    assert all(b > 0 for b in curve.bytes_sent)
    assert all(bool(torch.isfinite(w).all()) for w in curve.weights.values())


def test_the_h_option_sends_once_per_h_inner_steps() -> None:
    base = _base(windows=1, inner_steps=2)
    once, twice = parse_methods("demo,demo:h=1", base)
    _, dataset = open_run_dataset(base)
    setup = Setup(base, dataset, (0, 1), 1, heldout_set(dataset, base.run_id, 8), base.run_id)
    one = run_local(once, setup, lambda w, loss: None)
    two = run_local(twice, setup, lambda w, loss: None)
    assert 1.5 * one.bytes_sent[0] < two.bytes_sent[0]  # two updates in the window
    assert one.loss[0] != two.loss[0]


def test_select_now_is_the_variant_the_engine_builds() -> None:
    (method,) = parse_methods("greedylore:select=now", _base())
    spec = ModelSpec.from_module(build_model(method.run.model, 0))
    fmt = _strategy(method, spec).format
    assert isinstance(fmt, LowRankFormat) and isinstance(fmt.basis, NowBasis)
