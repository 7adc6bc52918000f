"""Scoring on real updates: secret samples (commit–reveal), norm-fair scores, the own-data test,
fair and robust pay, and the rule each report names.

The updates come from three real peers (the tiny preset, 4 inner steps) trained on their own
assignments of window 0; copies, scaled and random updates are built from them.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from codec.aggregate import update_norm
from codec.compress import SparseTensor
from lab.sim.forgeries import noise_update
from node.data.sampling import eval_slots
from protocol.keys import create_hotkey
from protocol.runconfig import RunConfig
from tests.support.honest_updates import HonestWorld
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.probe_start import ProbeStart
from validator.ratings import Book, WindowOutcome
from validator.reports import ScoreReport, WindowResult, build_report, verify_report_samples
from validator.reveal import (
    CommitRecord,
    RevealError,
    commitment,
    own_slots,
    reveal_for,
    sample_seed,
    signed_commit,
    window_secret,
)
from validator.scoring import LossProbe, LossScore, OwnTest, pick_scored, reference_norm
from validator.state import ValidatorState, load_state, save_state

RUN = RunConfig.preset(
    "tiny", name="vsc", inner_steps=4, outer={"total_windows": 10}, optimizer={"warmup_steps": 4}
)
N = 32  # random samples; own samples: all 32 a peer has at 4 x 8
CFG = ValidatorConfig(n_random=N, n_own=N)
CPU = torch.device("cpu")
WINDOW = 0


def secret(i: int) -> bytes:
    """Fixed secrets keep the test deterministic (a real validator draws `new_reveal_key`)."""
    return hashlib.blake2b(f"test secret {i}".encode(), digest_size=32).digest()


class World(HonestWorld):
    def __init__(self) -> None:
        super().__init__(RUN, range(3), WINDOW)
        self.norms = {u: update_norm(x) for u, x in self.updates.items()}
        self.target = reference_norm(self.norms)  # T

    def probe(self, key: bytes, reference: dict | None = None) -> LossProbe:
        reveal = reveal_for(self.dataset, RUN.run_id, WINDOW, key, N, N)
        ref = self.updates if reference is None else reference
        return LossProbe(self.model, RUN, self.dataset, WINDOW, reveal, ref, self.norms, CFG, CPU)


@pytest.fixture(scope="module")
def world() -> World:
    return World()


def scaled(update: list[SparseTensor], c: float) -> list[SparseTensor]:
    return [SparseTensor(s.name, s.shape, s.groups, s.codebook * c) for s in update]


# -- 1. unpredictable, verifiable samples ----------------------------------------------------------


def test_samples_need_the_secret(world: World) -> None:
    """Everything public before the deadline (run id, window, uids, the commitment) does not fix
    the samples: two secrets give different random batches and own picks, and neither is the old
    public draw nor the draw a peer would make by using the commitment as the secret."""
    ds = world.dataset
    a, b = secret(1), secret(2)
    ra, rb = (reveal_for(ds, RUN.run_id, WINDOW, s, 64, 16) for s in (a, b))
    assert ra.commit == commitment(a) != rb.commit
    assert set(ra.random_slots) != set(rb.random_slots)
    assert len(set(ra.random_slots) & set(rb.random_slots)) < 16  # ~64 * 64 / 5162 in common
    public = eval_slots(ds, RUN.run_id, WINDOW, "validator-random", 64, split="train").tolist()
    guess = sample_seed(RUN.run_id, WINDOW, bytes.fromhex(ra.commit))
    assert ra.random_slots not in (public, rb.random_slots)
    assert guess != ra.seed
    own_a, own_b = (own_slots(ds, RUN, 7, WINDOW, r.seed, 16).tolist() for r in (ra, rb))
    assert own_a != own_b
    # the secrets of other windows are unrelated to a revealed one, and a restart re-derives them
    key = secret(3)
    assert window_secret(key, RUN.run_id, 1) != window_secret(key, RUN.run_id, 2)
    assert window_secret(key, RUN.run_id, 1) == window_secret(bytes(key), RUN.run_id, 1)


def _report(world: World, window_key: bytes, losses: dict[int, LossScore]) -> ScoreReport:
    reveal = reveal_for(world.dataset, RUN.run_id, WINDOW, window_key, N, N)
    checks = {u: PeerCheck(u, f"hk{u}", None, Verdict.OK, "ok", norm=1.0) for u in losses}
    book = Book(CFG)
    book.update({u: _outcome(f"hk{u}", s.score, s.own.z) for u, s in losses.items()})
    result = WindowResult(
        run_id=RUN.run_id, window=WINDOW, validator_uid=10, validator_hotkey="val",
        fingerprint_start="a", fingerprint_end="b", selected=[], aggregated=[], weights={},
        weights_status="", config=CFG, samples=reveal,
    )  # fmt: skip
    return build_report(result, checks, losses, book)


def test_verifier_recomputes_the_samples_and_refuses_a_wrong_secret(
    world: World, tmp_path: Path
) -> None:
    key = secret(4)
    committed = window_secret(key, RUN.run_id, WINDOW)
    probe = world.probe(committed)
    losses = {u: probe.score(u, world.updates[u], world.norms[u], world.target) for u in (0, 1)}
    published = _report(world, committed, losses).model_dump_json()
    report = ScoreReport.model_validate_json(published)
    keypair = create_hotkey("t", "val", root=tmp_path)
    record = signed_commit(keypair, RUN.run_id, WINDOW, 9, key)
    report = report.model_copy(update={"validator_hotkey": keypair.ss58_address})
    own = verify_report_samples(report, world.dataset, RUN, record)
    assert own == {u: list(losses[u].own_slots) for u in (0, 1)}
    assert report.samples is not None
    batch = world.dataset.read_slots(np.asarray(report.samples.random_slots))
    assert torch.equal(batch, probe.random)  # the exact samples that were scored

    other = secret(5)  # self-consistent, but not the committed secret
    forged = _report(world, other, losses).model_copy(
        update={"validator_hotkey": keypair.ss58_address}
    )
    with pytest.raises(RevealError, match="commitment"):
        verify_report_samples(forged, world.dataset, RUN, record)
    samples = report.samples.model_copy(update={"secret": other.hex()})  # commit kept
    with pytest.raises(RevealError, match="commitment"):
        verify_report_samples(report.model_copy(update={"samples": samples}), world.dataset, RUN)
    peers = [p.model_copy(deep=True) for p in report.peers]
    assert peers[0].loss is not None
    peers[0].loss.own_slots[0] += 1
    with pytest.raises(RevealError, match="own slots"):
        verify_report_samples(report.model_copy(update={"peers": peers}), world.dataset, RUN)
    unsigned = CommitRecord(**{**record.model_dump(), "signature": "ab" * 64})
    with pytest.raises(RevealError, match="signature"):
        verify_report_samples(report, world.dataset, RUN, unsigned)


def test_the_reveal_key_survives_a_restart(tmp_path: Path) -> None:
    key = secret(6)
    state = ValidatorState(
        run_id=RUN.run_id, window=3, model={"w": torch.zeros(2)}, fingerprint="f", salt=1,
        reveal_key=key,
    )  # fmt: skip
    save_state(tmp_path, state)
    back = load_state(tmp_path, RUN.run_id)
    assert back is not None and back.reveal_key == key


# -- 2. norm-fair scores ---------------------------------------------------------------------------


def test_scaling_an_update_never_raises_its_score_or_rank(world: World) -> None:
    probe = world.probe(secret(7))
    base = {
        u: probe.score(u, world.updates[u], world.norms[u], world.target) for u in world.updates
    }
    u0 = base[0]
    assert u0.score > 0 and u0.norm_factor == 1.0
    for c in (0.2, 5.0, 50.0):
        up = scaled(world.updates[0], c)
        s = probe.score(0, up, update_norm(up), world.target)
        assert s.direction_score == pytest.approx(u0.direction_score, rel=1e-3)  # direction only
        assert s.score <= u0.score * 0.5  # outside the band: q = 2 min(c, 1/c) <= 0.4
        ranked = sorted([*(b.score for b in base.values()), s.score], reverse=True)
        assert ranked.index(s.score) > ranked.index(u0.score)
    inside = scaled(world.updates[0], 1.5)
    s = probe.score(0, inside, update_norm(inside), world.target)
    assert s.score == pytest.approx(u0.score, rel=1e-3)  # inside the band: nothing changes


def test_a_peer_probed_again_costs_two_forward_passes_and_reads_the_same(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lead probes an update at its own norm, then every validator at ``T``: the own
    samples' losses at the start and under the consensus step are the peer's whatever the update
    or the norm, so the second probe runs only the update's two forward passes, and it reads
    exactly what a fresh probe reads."""
    probe = world.probe(secret(9))
    passes = _count_passes(probe.base, monkeypatch)
    probe.score(0, world.updates[0], world.norms[0], world.norms[0])
    first = len(passes)
    again = probe.score(0, world.updates[0], world.norms[0], world.target)
    assert (first, len(passes) - first) == (4, 2)
    assert again == world.probe(secret(9)).score(0, world.updates[0], world.norms[0], world.target)


def _count_passes(start: ProbeStart, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the forward passes `start` runs from now on."""
    passes: list[int] = []
    rows = start.rows

    def counted(batch: torch.Tensor) -> np.ndarray:
        passes.append(len(batch))
        return rows(batch)

    monkeypatch.setattr(start, "rows", counted)
    return passes


def test_the_passes_at_the_windows_start_taken_early_read_what_a_probe_reads(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The passes that need no update (`validator.probe_start`), taken before the gather: after
    it, a peer's score runs only its update's two passes and the consensus step's one on its own
    samples, and reads exactly what a probe that took everything itself reads, with the launch
    covariate (the previous step) and without it. A preparation that runs out of time keeps what
    it took; the probe takes the rest."""
    key = secret(10)
    reveal = reveal_for(world.dataset, RUN.run_id, WINDOW, key, N, N)
    gen = torch.Generator().manual_seed(10)
    previous = {
        n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in world.model.named_parameters()
    }
    peers = sorted(world.updates)

    def scores(probe: LossProbe) -> dict[int, LossScore]:
        return {u: probe.score(u, world.updates[u], world.norms[u], world.target) for u in peers}

    def probe(start: ProbeStart | None, prev: dict | None) -> LossProbe:
        return LossProbe(
            world.model, RUN, world.dataset, WINDOW, reveal, world.updates, world.norms, CFG, CPU,
            previous=prev, start=start,
        )  # fmt: skip

    for prev in (None, previous):
        start = ProbeStart(world.model, RUN, world.dataset, WINDOW, reveal, CFG, CPU)
        start.use_previous(prev)
        assert start.prepare(peers, lambda: False) == len(peers)
        passes = _count_passes(start, monkeypatch)
        early = scores(probe(start, prev))
        assert len(passes) == 1 + 3 * len(peers)  # the consensus step's on R; per peer 1 + 2
        assert early == scores(probe(None, prev))
    # taken with the previous step, used without it (a launch no longer): the same as never taken
    start = ProbeStart(world.model, RUN, world.dataset, WINDOW, reveal, CFG, CPU)
    start.use_previous(previous)
    start.prepare(peers, lambda: False)
    assert scores(probe(start, None)) == scores(probe(None, None))
    # stopped after its random samples' micro-batches and a few of the first peer's
    asked = itertools.count()
    start = ProbeStart(world.model, RUN, world.dataset, WINDOW, reveal, CFG, CPU)
    micro = -(-N // RUN.micro_batch_size)
    assert start.prepare(peers, lambda: next(asked) > micro + 1) == 0
    assert scores(probe(start, None)) == scores(probe(None, None))


def test_a_scaled_peer_earns_less_than_the_same_work_unscaled(world: World) -> None:
    probe = world.probe(secret(8))
    honest = probe.score(0, world.updates[0], world.norms[0], world.target)
    up = scaled(world.updates[0], 5.0)
    big = probe.score(0, up, update_norm(up), world.target)
    book = Book(CFG)
    for _ in range(6):
        book.update(
            {
                0: _outcome("a", honest.score, honest.own.z),
                1: _outcome("b", big.score, big.own.z),
            }
        )
    final = book.final_scores()
    assert book.records[1].ordinal < book.records[0].ordinal
    assert 0 < final[1] < final[0]


# -- 3. the own-data test --------------------------------------------------------------------------


def test_own_data_test_passes_honest_updates_and_not_copies(world: World) -> None:
    probe = world.probe(secret(9))
    welch_probe = world.probe(secret(10), reference={})
    for uid, up in world.updates.items():
        s = probe.score(uid, up, world.norms[uid], world.target)
        assert s.own.method == "ancova" and s.indicator == 1
        w = welch_probe.score(uid, up, world.norms[uid], world.target)
        assert w.own.method == "welch" and s.own.z > w.own.z  # the covariate sharpens the test
    honest_z = [
        probe.score(u, up, world.norms[u], world.target).own.z for u, up in world.updates.items()
    ]
    for claimed, copied in ((7, 0), (8, 1), (9, 2)):  # copies, under uids whose data they never saw
        s = probe.score(claimed, world.updates[copied], world.norms[copied], world.target)
        assert s.indicator == -1 and s.own.z < min(honest_z) - 2
    honest = probe.score(2, world.updates[2], world.norms[2], world.target)
    noise_z = []
    for seed in (3, 4, 5):  # a noise uploader, uid 10
        noise = noise_update(world.spec, RUN, 0.01, torch.Generator().manual_seed(seed))
        s = probe.score(10, noise, update_norm(noise), world.target)
        assert abs(s.score) < 0.1 * honest.score
        noise_z.append(s.own.z)
    assert sum(noise_z) / 3 < 1.5 < min(honest_z) - 2


# -- pay -------------------------------------------------------------------------------------------


def _outcome(hk: str, score: float, own_z: float, effect: float = 1.0) -> WindowOutcome:
    return WindowOutcome(
        hotkey=hk, verdict=Verdict.OK, in_sync=True, score=score, own_z=own_z, own_effect=effect
    )


def _spread(weights: dict[int, float], uids: list[int]) -> float:
    mean = sum(weights[u] for u in uids) / len(uids)
    return max(abs(weights[u] / mean - 1) for u in uids)


def _weights(book: Book) -> dict[int, float]:
    final = book.final_scores()
    total = sum(final.values())
    return {u: v / total if total > 0 else 0.0 for u, v in final.items()}


def test_equal_work_equal_pay_and_nothing_for_nulls() -> None:
    """Four honest peers with the measured noise (score ±14 % per window, own_z ~ N(4.4, 1.8),
    own-data effect 1 ± 0.12 of the median) are paid within ±20 % of each other in every window
    after the first three; a copy-like null (own_z ~ N(0, 1), effect 0 ± 0.12), a freeloader and
    a noise uploader get nothing, window after window."""
    rng = random.Random(5)
    book = Book(CFG)
    honest = [0, 1, 2, 3]
    for w in range(14):
        mu = 0.01 * 0.85**w
        outcomes = {
            u: _outcome(
                f"h{u}",
                mu * (1 + 0.14 * rng.gauss(0, 1)),
                rng.gauss(4.4, 1.8),
                rng.gauss(1, 0.12),
            )
            for u in honest
        }
        outcomes[10] = _outcome("copy", mu, rng.gauss(0, 1), rng.gauss(0, 0.12))
        outcomes[11] = _outcome("freeloader", 0.0, 0.0, 0.0)
        outcomes[12] = _outcome(
            "noise", mu * 0.01 * rng.gauss(0, 1), rng.gauss(0, 1), rng.gauss(0, 0.12)
        )
        book.update(outcomes)
        weights = _weights(book)
        if w >= 3:
            assert _spread(weights, honest) <= 0.2, (w, weights)
        assert weights[10] == weights[11] == weights[12] == 0.0, (w, weights)


def test_accepted_updates_are_scored_before_refused_ones() -> None:
    """Copies and replays are scored only for the report: when time runs out, a crowd of them
    never leaves an accepted update unscored. Within each group the order is a hash of (run,
    window), so no uid is always last."""
    accepted, refused = set(range(0, 40, 4)), [u for u in range(40) if u % 4]
    orders = [pick_scored(RUN.run_id, w, list(range(40)), 0, accepted) for w in range(6)]
    for order in orders:
        assert set(order[: len(accepted)]) == accepted
        assert sorted(order) == list(range(40))
    assert len({tuple(o[: len(accepted)]) for o in orders}) == len(orders)
    assert len({o[-1] for o in orders}) > 1
    assert pick_scored(RUN.run_id, 0, refused, 3, accepted) == orders[0][len(accepted) :][:3]


# The three honest peers' scores in `tessera sim --peers 3 --windows 6 --adversaries mixer,scaled,
# recycler,copier,stale,freeloader` (None: left unscored, the validator out of time).
SIM_SCORES = [
    (0.01784, 0.01691, 0.01679),
    (None, 0.03085, 0.02949),
    (0.02459, None, 0.02506),
    (0.02694, None, 0.02906),
    (0.01577, 0.01392, None),
    (0.00736, 0.00801, 0.00714),
]


def test_equal_pay_when_each_window_leaves_another_peer_unscored() -> None:
    """The measured failure: a validator out of time leaves a different honest peer unscored in
    some windows while the scores rise and then fall fourfold; with the raw score in a gain EMA
    that starts at 0, the peer skipped early kept a low gain and one skipped late a high one:
    ±21–23 % between equal peers from window 2 on, as in the simulation. Replayed here (own-data
    evidence held at z = 7, what `scripts/experiments/validator_fairness.py` measures for honest peers), each
    peer is paid within ±10 % of the others in every window, and a freeloader beside them gets
    nothing."""
    book = Book(CFG)
    for w, scores in enumerate(SIM_SCORES):
        outcomes = {
            u: _outcome(f"h{u}", s, 7.0)
            if s is not None
            else WindowOutcome(hotkey=f"h{u}", verdict=Verdict.OK)
            for u, s in enumerate(scores)
        }
        outcomes[10] = _outcome("freeloader", 0.0, 0.0)
        book.update(outcomes)
        weights = _weights(book)
        assert _spread(weights, [0, 1, 2]) <= 0.1, (w, weights)
        assert weights[10] == 0.0


def test_one_noisy_window_does_not_cut_an_honest_peer() -> None:
    """The measured failure: an honest peer whose own-data test came out negative once (a
    difference of 5e-6) lost 90 % of its pay. Now one window without evidence leaves it paid
    like its equals; only a sustained lack of evidence (a null update) takes the pay away."""
    book = Book(CFG)
    for w in range(10):
        bad = w == 6
        book.update({u: _outcome(f"h{u}", 0.01, 0.0 if bad and u == 0 else 4.0) for u in range(3)})
        weights = _weights(book)
        if w >= 3:
            assert _spread(weights, [0, 1, 2]) <= 0.2, (w, weights)
    assert book.own_factor(book.records[0]) == 1.0
    for _ in range(CFG.own_windows):  # a whole pool without evidence: not honest work any more
        book.update({u: _outcome(f"h{u}", 0.01, 0.0 if u == 0 else 4.0) for u in range(3)})
    assert book.final_scores()[0] == 0.0


# -- 4. the report names the rule ------------------------------------------------------------------


def test_report_names_the_rule_that_decided_each_weight(world: World) -> None:
    probe = world.probe(secret(11))
    good = {u: probe.score(u, world.updates[u], world.norms[u], world.target) for u in (0, 1)}
    big = scaled(world.updates[2], 5.0)
    losses = {
        **good,
        2: probe.score(2, big, update_norm(big), world.target),
        3: replace(good[0], own=OwnTest(0.0, 0.0, 1.0, "ancova")),  # trained on nothing of its own
        4: replace(good[0], loss_after_random=good[0].loss_before_random),  # moves nothing
        5: good[0],
        6: good[1],
    }
    book = Book(CFG)
    verdicts = {5: Verdict.COPY, 6: Verdict.REPLAY, 7: Verdict.NORM_OUTLIER, 8: Verdict.MISSING}
    checks = {
        u: PeerCheck(u, f"hk{u}", None, verdicts.get(u, Verdict.OK), "", norm=1.0)
        for u in range(10)
    }  # uid 9: ok every window, never scored (a loaded validator had no time for it)
    for _ in range(5):
        book.update(
            {
                u: WindowOutcome(
                    hotkey=f"hk{u}",
                    verdict=c.verdict,
                    in_sync=True,
                    score=losses[u].score if u in losses else None,
                    own_z=losses[u].own.z if u in losses else None,
                    own_effect=losses[u].own.diff if u in losses else None,
                )
                for u, c in checks.items()
            }
        )
    result = WindowResult(
        run_id=RUN.run_id, window=WINDOW, validator_uid=10, validator_hotkey="val",
        fingerprint_start="a", fingerprint_end="b", selected=[], aggregated=[],
        weights=_weights(book), weights_status="", config=CFG,
    )  # fmt: skip
    report = build_report(result, checks, losses, book)
    rule = {p.uid: p.rule for p in report.peers}
    assert rule == {
        0: "ok", 1: "ok", 2: "norm band", 3: "indicator", 4: "gain gate", 5: "copy",
        6: "replay", 7: "norm_outlier", 8: "missing", 9: "unscored",
    }  # fmt: skip
    weights = _weights(book)
    assert weights[0] > 0 and weights[1] > 0 and 0 < weights[2] < min(weights[0], weights[1])
    assert all(weights[u] == 0 for u in range(3, 10))
