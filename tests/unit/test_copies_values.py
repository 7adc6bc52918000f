"""Value-aware copy detection on real updates: every derivative an attacker can build from other
peers' updates is explained by them; honest updates trained on disjoint data are not.

Four honest peers of the tiny preset train window 0 on their own assignments from the same
start (`honest_updates`); the derivatives are built from them with the real codec.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
import torch

from codec.aggregate import clip_factors, update_norm
from codec.compress import SparseTensor, densify, scatter_add
from codec.spec import ModelSpec
from lab.sim.forgeries import chunk_mix, from_dense, requantised
from node.data.batches import open_run_dataset
from node.model.llama import build_model
from node.strategy import make_strategy
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.copies import (
    Sketch,
    SketchHistory,
    Stamp,
    aggregate_sketch,
    explain,
    explain_window,
    sketch,
)

RUN = RunConfig.preset("tiny", name="values", inner_steps=4, optimizer={"warmup_steps": 4})
CFG = ValidatorConfig()
THRESHOLD, REPLAY = CFG.copy_threshold, CFG.replay_threshold
HONEST = (0, 1, 2, 3)
T0 = datetime(2026, 1, 1, tzinfo=UTC)

Update = list[SparseTensor]


class World:
    def __init__(self) -> None:
        from tests.support.honest_updates import train_update

        _, dataset = open_run_dataset(RUN)
        model = build_model(RUN.model, RUN.seed)
        self.spec = ModelSpec.from_module(model)
        self.updates = {u: train_update(RUN, dataset, model, u, 0) for u in HONEST}
        ups = [self.updates[u] for u in HONEST]
        self.factors = [f / len(ups) for f in clip_factors([update_norm(u) for u in ups])]
        self.mean = {t.name: torch.zeros(t.shape) for t in self.spec.tensors}
        for f, up in zip(self.factors, ups, strict=True):
            for s in up:
                scatter_add(self.mean[s.name], s, RUN.codec, f)
        consensus = make_strategy(RUN, self.spec)
        consensus.outer.receive(self.mean, 0)
        consensus.outer.advance(model)  # window 1 starts from the mean
        self.next = {u: train_update(RUN, dataset, model, u, 1) for u in HONEST}

    def sk(self, uid: int, update: Update, window: int = 0) -> Sketch:
        return sketch(
            uid, window, bytes([uid, window]) * 16, update, self.spec, RUN.codec, 1 << 16, 7
        )

    def window0(self) -> list[Sketch]:
        return [self.sk(u, self.updates[u]) for u in HONEST]

    def aggregate0(self) -> Sketch:
        return aggregate_sketch(0, self.window0(), self.factors)

    def dense(self, update: Update) -> dict[str, torch.Tensor]:
        return {s.name: densify(s, RUN.codec) for s in update}


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def _share(world: World, suspect: Update, sources: dict[int, Update]) -> float:
    """The share of `suspect` that this window's `sources` explain."""
    return explain(world.sk(9, suspect), [world.sk(u, up) for u, up in sources.items()]).share


def test_honest_updates_do_not_explain_each_other(world: World) -> None:
    sketches = {u: world.sk(u, world.updates[u]) for u in HONEST}
    stamps = {u: Stamp(T0, False) for u in HONEST}  # unknown order: everyone is a candidate
    shares = {
        u: e.window.share
        for u, e in explain_window(sketches, stamps, SketchHistory(4), REPLAY).items()
    }
    assert max(shares.values()) < THRESHOLD / 2, shares


@pytest.mark.parametrize("share_a", [0.5, 0.6])
def test_chunk_mixes_are_explained(world: World, share_a: float) -> None:
    gen = torch.Generator().manual_seed(int(share_a * 10))
    a, b = world.updates[0], world.updates[1]
    mix = chunk_mix(a, b, 1 - share_a, gen, world.spec, RUN)
    others = {u: world.updates[u] for u in HONEST}
    assert _share(world, mix, others) >= THRESHOLD


def test_top_k_of_a_sum_is_explained(world: World) -> None:
    da, db = world.dense(world.updates[0]), world.dense(world.updates[1])
    summed = from_dense({n: da[n] + db[n] for n in da}, world.spec, RUN)
    assert _share(world, summed, {u: world.updates[u] for u in HONEST}) >= THRESHOLD


def test_a_sign_preserving_requantised_copy_is_explained(world: World) -> None:
    copy = requantised(world.updates[2], world.spec, RUN, torch.Generator().manual_seed(3))
    assert _share(world, copy, {u: world.updates[u] for u in HONEST}) >= THRESHOLD


def test_a_scaled_copy_is_explained(world: World) -> None:
    big = [SparseTensor(s.name, s.shape, s.groups, s.codebook * 5) for s in world.updates[3]]
    assert _share(world, big, {3: world.updates[3]}) >= 0.99


def test_a_recycled_aggregate_is_explained_by_the_history(world: World) -> None:
    """The previous window's applied mean, re-compressed and uploaded as the next window's
    update: explained by that window's aggregate sketch."""
    recycled = from_dense(world.mean, world.spec, RUN)
    x = world.sk(9, recycled, window=1)
    d = explain(x, [*world.window0(), world.aggregate0()], max_sources=1)
    assert d.share >= REPLAY and d.sources == ((-1, 0),)


def test_next_window_honest_updates_are_not_explained_by_the_history(world: World) -> None:
    """An honest update of window 1 against every update of window 0 (its own included) and the
    aggregate window 0 applied, and against the other honest updates of window 1."""
    history = SketchHistory(4)
    history.add(0, [*world.window0(), world.aggregate0()])
    sketches = {u: world.sk(u, world.next[u], window=1) for u in HONEST}
    stamps = {u: Stamp(T0, False) for u in HONEST}
    explained = explain_window(sketches, stamps, history, REPLAY)
    by_window = {u: e.window.share for u, e in explained.items()}
    by_history = {u: e.history.share for u, e in explained.items()}
    assert max(by_window.values()) < THRESHOLD, by_window
    assert max(by_history.values()) < REPLAY, by_history


def test_the_copier_is_the_later_upload_and_an_untrusted_clock_never_wins(world: World) -> None:
    copy = requantised(world.updates[0], world.spec, RUN, torch.Generator().manual_seed(5))
    sketches = {0: world.sk(0, world.updates[0]), 5: world.sk(5, copy)}
    later = T0 + timedelta(seconds=3)
    cases = {
        "copier later": ({0: Stamp(T0, True), 5: Stamp(later, True)}, 5),
        "copier claims an early time on its own server": (
            {0: Stamp(later, True), 5: Stamp(T0 - timedelta(hours=1), False)}, 5
        ),
    }  # fmt: skip
    for name, (stamps, copier) in cases.items():
        explained = explain_window(sketches, stamps, SketchHistory(4), REPLAY)
        shares = {u: e.window.share for u, e in explained.items()}
        assert shares[copier] >= THRESHOLD, name
        assert shares[0] < THRESHOLD, name


def _synthetic(uid: int, window: int, values: np.ndarray) -> Sketch:
    positions = np.arange(values.size, dtype=np.uint64) * np.uint64(3)
    return Sketch(uid, window, bytes([uid, window]), positions, values.astype(np.float32))


def test_a_peers_own_earlier_update_never_makes_it_a_replay() -> None:
    """Error feedback makes a peer's late updates mostly its previous ones (the main job: shares
    0.85-0.94 from window 7): that is its own work, not a replay; the same bytes under another
    uid are one."""
    rng = np.random.default_rng(0)
    before = rng.standard_normal(4000)
    now = before + 0.2 * rng.standard_normal(4000)  # 96 % of the energy is the previous update
    history = SketchHistory(4)
    history.add(6, [_synthetic(1, 6, before)])
    own = explain_window({1: _synthetic(1, 7, now)}, {}, history, REPLAY)[1]
    assert own.history.share == 0.0
    other = explain_window({2: _synthetic(2, 7, now)}, {}, history, REPLAY)[2]
    assert other.history.share >= REPLAY and other.history.sources == ((1, 6),)


def test_a_stale_copy_of_a_peers_previous_update_never_makes_the_peer_a_copier() -> None:
    """The stale attacker uploads peer 0's previous update early in the window; peer 0's fresh
    update, mostly its previous one through error feedback, must not be explained by it."""
    rng = np.random.default_rng(1)
    before = rng.standard_normal(4000)
    history = SketchHistory(4)
    history.add(6, [_synthetic(0, 6, before)])
    sketches = {
        0: _synthetic(0, 7, before + 0.3 * rng.standard_normal(4000)),
        6: _synthetic(6, 7, before),  # the stale copy
    }
    stamps = {0: Stamp(T0 + timedelta(seconds=5), True), 6: Stamp(T0, True)}
    explained = explain_window(sketches, stamps, history, REPLAY)
    assert explained[6].history.share >= REPLAY  # the stale copy is a replay of peer 0's
    assert explained[0].window.share < THRESHOLD and explained[0].history.share == 0.0
