"""``outer.delay = 1``: each window's aggregate is applied one window late, by every role alike.

The consensus schedule (`OuterOptimizer.step`: validators, history replay, the bench) and the
peer's (`receive` once the exchange lands, then `advance`) give the same weights and outer state bit for
bit; the held mean travels in the outer state, so checkpoints, catch-up and restarts keep it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from codec.spec import ModelSpec
from lab.bench.train.engine import Setup, heldout_set, run_local
from lab.bench.train.specs import parse_methods
from node.data.batches import open_run_dataset
from node.model.fingerprint import fingerprint
from node.model.llama import build_model
from node.strategy import make_strategy
from node.window.exchange import encode_signed
from node.window.history import (
    HistoryError,
    Source,
    catch_up,
    latest_checkpoint,
    publish_aggregate,
    publish_checkpoint,
)
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from protocol.stores import open_store

SHAPES = {"w": (48, 80), "b": (200,)}
SPEC = ModelSpec.from_shapes(SHAPES)


class Params(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(SHAPES["w"]))
        self.b = torch.nn.Parameter(torch.zeros(SHAPES["b"]))


def _run(strategy: str = "diloco", **outer: object) -> RunConfig:
    return RunConfig.preset(
        "tiny", name="delay", strategy=strategy, dense={"dtype": "fp32"},
        codec={"tile": 16, "k": 12, "max_abs_value": 1e6},
        outer={"total_windows": 20, "ef_freeze_fraction": 0.1, "delay": 1, **outer},
    )  # fmt: skip


def _update(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def test_each_aggregate_is_applied_one_window_late() -> None:
    """Outer SGD: θ_{w+1} = θ_w − α · mean_{w−1}, and mean_w is held (one update per window: the
    mean of one dense fp32 update is that update)."""
    run = _run(alpha=0.5)
    strategy = make_strategy(run, SPEC)
    model = Params()
    means = [_update(w) for w in range(4)]
    for w, mean in enumerate(means):
        pieces = strategy.encoder.encode(mean, w)
        strategy.outer.step(model, strategy.aggregator.mean({7: pieces}), w)
        for n in SHAPES:
            applied = sum((means[v][n] for v in range(w)), torch.zeros(SHAPES[n]))
            torch.testing.assert_close(getattr(model, n).detach(), -0.5 * applied)
    held = strategy.outer.state_dict()
    assert set(held) == {f"held.{n}" for n in SHAPES}
    assert all(torch.equal(held[f"held.{n}"], means[3][n]) for n in SHAPES)


@pytest.mark.parametrize("optimizer", ["sgd", "nesterov"])
def test_the_peer_schedule_is_the_consensus_schedule(optimizer: str) -> None:
    """A validator steps each window as its updates arrive; a peer receives window w − 1's mean
    only after training w, then advances from θ_w. Same weights and momentum, bit for bit, also
    across a peer restart from its saved outer state."""
    run = _run(optimizer=optimizer, momentum=0.9, alpha=0.7)
    validator, peer = make_strategy(run, SPEC), make_strategy(run, SPEC)
    v_model, p_model = Params(), Params()
    updates = [{u: make_strategy(run, SPEC).encoder.encode(_update(10 * w + u), w) for u in range(3)}
               for w in range(5)]  # fmt: skip
    for w in range(5):
        start = {n: p.detach().clone() for n, p in p_model.named_parameters()}
        with torch.no_grad():
            for p in p_model.parameters():
                p.add_(1.0)  # the peer's inner steps move its weights; the step starts from θ_w
        if w >= 1:
            peer.outer.receive(peer.aggregator.mean(updates[w - 1]), w - 1)
        peer.outer.advance(p_model, start)
        validator.outer.step(v_model, validator.aggregator.mean(updates[w]), w)
        if w == 2:  # a restarted peer holds nothing: the next exchange lands afresh
            state = peer.outer.state_dict()
            assert not any(k.startswith("held.") for k in state)
            peer = make_strategy(run, SPEC)
            peer.outer.load_state_dict(state)
        for n in SHAPES:
            assert torch.equal(getattr(p_model, n), getattr(v_model, n)), (w, n)
    v_state = validator.outer.state_dict()
    p_state = peer.outer.state_dict()
    assert {k for k in v_state if not k.startswith("held.")} == set(p_state)
    assert all(torch.equal(v_state[k], p_state[k]) for k in p_state)


def test_outer_state_groups_are_whole_and_belong_to_the_run() -> None:
    run = _run()
    strategy = make_strategy(run, SPEC)
    strategy.outer.receive({n: torch.ones(s) for n, s in SHAPES.items()}, 0)
    state = strategy.outer.state_dict()
    with pytest.raises(ValueError, match="covers 1 of 2"):
        make_strategy(run, SPEC).outer.load_state_dict({"held.w": state["held.w"]})
    with pytest.raises(ValueError, match="does not fit"):
        make_strategy(_run(delay=0), SPEC).outer.load_state_dict(state)
    with pytest.raises(ValueError, match="finite"):
        make_strategy(run, SPEC).outer.load_state_dict(
            {**state, "held.b": torch.full(SHAPES["b"], float("nan"))}
        )
    with pytest.raises(RuntimeError, match="already held"):
        strategy.outer.receive({n: torch.ones(s) for n, s in SHAPES.items()}, 1)


def test_a_late_peer_replays_a_delayed_run_from_a_checkpoint(tmp_path: Path) -> None:
    """Nesterov and delay 1: the checkpoint carries momentum and the held mean, so a late peer
    that starts from it (windows 0-1 never published) lands on the live weights and state."""
    run = RunConfig.preset(
        "tiny", name="history-delay", strategy="diloco",
        outer={"optimizer": "nesterov", "momentum": 0.9, "alpha": 0.7, "delay": 1},
    )  # fmt: skip
    keys = [create_hotkey("w", f"k{i}", root=tmp_path / "wallets") for i in range(3)]
    store = open_store(f"file://{tmp_path}?bucket=validator")
    hotkeys = {i: k.ss58_address for i, k in enumerate(keys)}
    source = Source(2, keys[2].ss58_address, store)
    live = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(live)
    strategy = make_strategy(run, spec)
    gen = torch.Generator().manual_seed(1)
    for window in range(5):
        if window == 2:
            outer = strategy.outer.state_dict()
            assert {k.split(".")[0] for k in outer} == {"momentum", "held"}
            publish_checkpoint(store, run, window, 2, keys[2], live, outer=outer)
        raw = {}
        for uid in range(2):
            deltas = {
                n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in live.named_parameters()
            }
            update = make_strategy(run, spec).encoder.encode(deltas, window)
            raw[uid] = encode_signed(update, run, spec, window, uid, keys[uid])
        publish_aggregate(store, run, window, 2, keys[2], raw, hotkeys)
        assert (
            catch_up(live, strategy.aggregator, strategy.outer, source, window, window + 1)
            == window + 1
        )
    store.delete(
        next(i.key for i in store.list() if "/w0000000000/" in i.key and "aggregate" in i.key)
    )

    late = build_model(run.model, run.seed)
    late_strategy = make_strategy(run, spec)
    assert catch_up(late, late_strategy.aggregator, late_strategy.outer, source, 0, 5) == 5
    assert fingerprint(late) == fingerprint(live)
    theirs, ours = late_strategy.outer.state_dict(), strategy.outer.state_dict()
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_a_checkpoint_with_a_misshapen_held_mean_is_not_used(tmp_path: Path) -> None:
    run = RunConfig.preset("tiny", name="history-bad", outer={"delay": 1})
    key = create_hotkey("w", "v", root=tmp_path / "wallets")
    store = open_store(f"file://{tmp_path}?bucket=validator")
    model = build_model(run.model, run.seed)
    spec = ModelSpec.from_module(model)
    strategy = make_strategy(run, spec)
    held = {f"held.{n}": torch.zeros(p.shape) for n, p in model.named_parameters()}
    name = next(iter(held))
    bad = {**held, name: torch.zeros(3)}
    publish_checkpoint(store, run, 1, 0, key, model, outer=bad)
    assert latest_checkpoint(Source(0, key.ss58_address, store), strategy.outer, 5) is None
    publish_checkpoint(store, run, 2, 0, key, model, outer=held)
    found = latest_checkpoint(Source(0, key.ss58_address, store), strategy.outer, 5)
    assert found is not None and found[0] == 2


def test_a_checkpoint_with_part_of_the_held_mean_is_refused_when_loaded(tmp_path: Path) -> None:
    """Every tensor fits, but the held mean covers one tensor of many: catch-up refuses it as one
    `HistoryError` instead of applying half a mean."""
    run = RunConfig.preset("tiny", name="history-part", outer={"delay": 1})
    key = create_hotkey("w", "v", root=tmp_path / "wallets")
    store = open_store(f"file://{tmp_path}?bucket=validator")
    model = build_model(run.model, run.seed)
    strategy = make_strategy(run, ModelSpec.from_module(model))
    name, shape = next(iter(strategy.outer.shapes().items()))
    publish_checkpoint(store, run, 1, 0, key, model, outer={name: torch.zeros(shape)})
    with pytest.raises(HistoryError, match="checkpoint of window 1: outer state 'held' covers 1"):
        catch_up(
            model, strategy.aggregator, strategy.outer, Source(0, key.ss58_address, store), 0, 5
        )


def test_a_step_that_lands_before_training_is_delay_zero_one_window_later() -> None:
    """In the bench, a delayed step taken before the window's first inner step (land = 0) trains
    like delay 0, one window later (window 0 has nothing to apply), up to the rounding of the
    live weights' jump ``θ + (new − old)``. Landing later (after the first of two inner steps
    here) trains differently; at the end the held mean is applied once more for
    `final_loss_all_applied`."""
    base = RunConfig.preset("tiny", name="delay-bench", inner_steps=2, outer={"total_windows": 3})
    methods = parse_methods(
        "sparseloco,sparseloco:delay=1,land=0,label=at once,sparseloco:delay=1,label=late", base
    )
    _, dataset = open_run_dataset(base)
    setup = Setup(base, dataset, (0, 1), 3, heldout_set(dataset, base.run_id, 8), base.run_id)
    now, at_once, late = (run_local(m, setup, lambda w, loss: None) for m in methods)
    assert at_once.loss[:2] == [at_once.initial_loss, now.loss[0]]  # nothing to round yet
    assert at_once.loss[2] == pytest.approx(now.loss[1], rel=1e-6)
    assert at_once.applied_loss == pytest.approx(now.loss[-1], rel=1e-6)
    assert now.applied_loss is None
    assert late.loss[:2] == at_once.loss[:2]
    assert late.applied_loss != pytest.approx(at_once.applied_loss, rel=1e-5)
