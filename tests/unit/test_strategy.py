"""The `Strategy` boundary: SparseLoCo's aggregate as before (bit for bit), the median clip and
uid order for dense updates too, the outer optimizers against PyTorch's, SparseLoCo reducing
exactly to dense local SGD, and the mean refusing an update whose tensors are not the model's."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from codec.aggregate import aggregate
from codec.compress import Compressor
from codec.dense import dense_norm, exact_norm
from codec.errors import DecodeError
from codec.spec import ModelSpec
from lab.bench.train.engine import Setup, heldout_set, run_local
from lab.bench.train.specs import parse_methods
from node.data.batches import open_run_dataset
from node.strategy import make_strategy
from node.strategy.outer import OuterOptimizer
from protocol.runconfig import RunConfig

SHAPES = {"w": (48, 80), "b": (200,), "x": (3, 5, 9)}
SPEC = ModelSpec.from_shapes(SHAPES)
CODEC = {"tile": 16, "k": 12, "max_abs_value": 1e6}


def _run(strategy: str, **outer: object) -> RunConfig:
    return RunConfig.preset(
        "tiny", name="strategy", strategy=strategy, codec=CODEC, dense={"dtype": "fp32"},
        outer={"total_windows": 20, "ef_freeze_fraction": 0.1, **outer},
    )  # fmt: skip


def _deltas(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) * scale for n, s in SHAPES.items()}


SCALES = [1.0, 0.5, 3.0, 1.5, 40.0]


def test_sparseloco_mean_is_the_codec_aggregate_bit_for_bit() -> None:
    run = _run("sparseloco")
    updates = {}
    for uid, scale in enumerate(SCALES):
        comp = Compressor(SPEC, run.codec)
        updates[uid] = [comp.compress(n, d, 0.95) for n, d in _deltas(uid, scale).items()]
    mean = make_strategy(run, SPEC).aggregator.mean(updates)
    ref = aggregate(updates, SPEC, run.codec, clip_to_median=True, validate=True)
    assert all(torch.equal(mean[n], ref[n]) for n in SHAPES)


def test_dense_mean_clips_to_the_median_norm_in_any_arrival_order() -> None:
    strategy = make_strategy(_run("diloco"), SPEC)
    updates = {uid: strategy.encoder.encode(_deltas(uid, s), 5) for uid, s in enumerate(SCALES)}
    mean = strategy.aggregator.mean(updates)
    norms = [
        math.sqrt(sum(float(t.values.double().square().sum()) for t in u)) for u in updates.values()
    ]
    median = sorted(norms)[(len(norms) - 1) // 2]  # the lower median
    count = sum(min(n, median) / median for n in norms)  # each counts min(norm, median)/median
    for name in SHAPES:
        ref = (
            sum(
                min(1.0, median / n) * next(t.values for t in u if t.name == name).double()
                for n, u in zip(norms, updates.values(), strict=True)
            )
            / count
        )
        torch.testing.assert_close(mean[name].double(), ref, rtol=1e-5, atol=1e-6)
    keys = list(updates)
    random.Random(0).shuffle(keys)
    again = strategy.aggregator.mean({k: list(reversed(updates[k])) for k in keys})
    assert all(torch.equal(mean[n], again[n]) for n in SHAPES)


def test_dense_norm_is_the_correctly_rounded_norm_in_any_order() -> None:
    gen = torch.Generator().manual_seed(3)
    parts = [
        torch.randn(10_000, generator=gen) * 1e-3,
        torch.tensor([1e-42, -3e-45, 3e38 / 1e19, 0.0, -0.0]),  # subnormals, large, zeros
        torch.randn(7, 9, generator=gen) * 1e4,
    ]
    exact = math.sqrt(math.fsum(float(x) ** 2 for p in parts for x in p.reshape(-1).tolist()))
    assert exact_norm(parts) == exact
    flat = torch.cat([p.reshape(-1) for p in parts])
    shuffled = flat[torch.randperm(flat.numel(), generator=gen)]
    assert exact_norm([shuffled[:3], shuffled[3:]]) == exact
    assert dense_norm([]) == 0.0


def test_nesterov_outer_step_is_torch_sgd_with_nesterov() -> None:
    run = _run("diloco", optimizer="nesterov", momentum=0.9, alpha=0.7)
    ours = torch.nn.Linear(6, 4, bias=False)
    ref = torch.nn.Linear(6, 4, bias=False)
    ref.load_state_dict(ours.state_dict())
    spec = ModelSpec.from_module(ours)
    outer = OuterOptimizer(run, spec)
    sgd = torch.optim.SGD(ref.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    gen = torch.Generator().manual_seed(4)
    for step in range(4):
        mean = {"weight": torch.randn(4, 6, generator=gen)}
        outer.receive(mean, step)
        outer.advance(ours)
        ref.weight.grad = mean["weight"].clone()
        sgd.step()
        torch.testing.assert_close(ours.weight, ref.weight, rtol=1e-6, atol=1e-6)
        if step == 1:  # a restart in the middle continues exactly
            state = outer.state_dict()
            outer = OuterOptimizer(run, spec)
            outer.load_state_dict(state)
    with pytest.raises(ValueError):
        outer.load_state_dict({"momentum.weight": torch.zeros(3)})


def test_sparseloco_with_every_entry_and_exact_values_is_dense_local_sgd() -> None:
    """k = chunk size, float32 values, no error feedback (β = 0), outer SGD α = 1: SparseLoCo
    sends each pseudo-gradient whole, so it must train exactly like dense local SGD. One
    replica: with more, the two means differ by design (SparseLoCo clips chunk by chunk, DiLoCo
    whole updates; each rule has its own tests)."""
    base = RunConfig.preset("tiny", name="equivalence", inner_steps=2, outer={"total_windows": 2})
    methods = parse_methods(
        "sparseloco:k=4096,values=fp32,beta=0,alpha=1,outer=sgd,"
        "diloco:dtype=fp32,alpha=1,outer=sgd",
        base,
    )
    _, dataset = open_run_dataset(base)
    setup = Setup(base, dataset, (0,), 2, heldout_set(dataset, base.run_id, 8), base.run_id)
    sparse, dense = (run_local(m, setup, lambda w, loss: None) for m in methods)
    for name, w in dense.weights.items():
        torch.testing.assert_close(sparse.weights[name], w, rtol=1e-6, atol=1e-7)
    assert sparse.loss == pytest.approx(dense.loss, rel=1e-6)
    assert dense.loss[-1] < dense.initial_loss  # it trained


def test_the_mean_refuses_what_decoding_refuses() -> None:
    """`mean` validates every piece again (values reach it from memory too, e.g. in replays)."""
    dense_run, sparse_run = _run("diloco"), _run("sparseloco")
    dense, sparse = make_strategy(dense_run, SPEC), make_strategy(sparse_run, SPEC)
    good = dense.encoder.encode(_deltas(0), 5)
    bad_values = {"nan": float("nan"), "above the cap": 2 * CODEC["max_abs_value"]}
    for what, value in bad_values.items():
        piece = good[0]
        values = piece.values.clone()
        values.view(-1)[3] = value
        with pytest.raises(DecodeError):
            dense.aggregator.mean({0: good, 1: [replace(piece, values=values), *good[1:]]})
            pytest.fail(what)
    comp = Compressor(SPEC, sparse_run.codec)
    sent = [comp.compress(n, d, 0.9) for n, d in _deltas(1).items()]
    with pytest.raises(DecodeError):
        dense.aggregator.mean({0: good, 1: sent})  # a sparse update in a dense run
    groups = [replace(g, idx=g.idx.flip(1)) for g in sent[0].groups]  # positions not ascending
    with pytest.raises(DecodeError):
        sparse.aggregator.mean({0: [replace(sent[0], groups=groups), *sent[1:]]})
    assert sparse.aggregator.mean({0: sent})  # the untouched update is fine


def _update(strategy: str, shapes: dict[str, tuple[int, ...]], seed: int) -> list:
    """An update of `strategy` for a model of `shapes` (SparseLoCo's compressed, DiLoCo's dense)."""
    run, spec = _run(strategy), ModelSpec.from_shapes(shapes)
    gen = torch.Generator().manual_seed(seed)
    deltas = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    if strategy == "sparseloco":
        comp = Compressor(spec, run.codec)
        return [comp.compress(n, d, 0.9) for n, d in deltas.items()]
    return make_strategy(run, spec).encoder.encode(deltas, 5)


@pytest.mark.parametrize("strategy", ["diloco", "sparseloco"])
def test_the_mean_refuses_tensors_the_model_does_not_have(strategy: str) -> None:
    """Each piece is one of the model's tensors, named once, in the model's shape: a piece under
    another name, a tensor sent twice (to count twice) or one whose shape is not the model's
    (well formed in itself, so validating the piece alone passes it) is refused, saying so."""
    aggregator = make_strategy(_run(strategy), SPEC).aggregator
    good = _update(strategy, SHAPES, seed=2)
    w = next(p for p in good if p.name == "w")
    others = [p for p in good if p.name != "w"]
    transposed = _update(strategy, {"w": (80, 48)}, seed=3)[0]
    refused = {
        "unknown tensor 'v'": [replace(w, name="v"), *others],
        "tensor 'w' appears twice in one update": [w, w, *others],
        r"w: shape \(80, 48\) != \(48, 80\)": [transposed, *others],
    }
    for message, update in refused.items():
        with pytest.raises(DecodeError, match=message):
            aggregator.mean({0: good, 1: update})
    assert aggregator.mean({0: good, 1: [w, *others]})  # the same pieces, each once
