"""The per-window score report the validator publishes (`protocol.naming.scores_key`).

Everything that went into every peer's score is in it, so anyone holding the same model (the
published checkpoints and aggregates) can recompute the loss scores, the ratings and the weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.copies import Match
from validator.ratings import Book
from validator.scoring import LossScore


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OverlapReport(_Model):
    other_uid: int
    other_window: int
    overlap: float


class LossReport(_Model):
    loss_before_random: float
    loss_after_random: float
    loss_before_own: float
    loss_after_own: float
    n_random: int
    n_own: int
    score: float
    own_gain: float
    indicator: int


class StandingReport(_Model):
    """The peer's record after this window, and the factors of its final score."""

    mu: float
    sigma: float
    ordinal: float
    shifted_ordinal: float
    indicator_ema: float
    gain_ema: float
    sync_ema: float
    penalty: float
    gain_gate: float
    final: float
    weight: float


class PeerReport(_Model):
    uid: int
    hotkey: str
    verdict: Verdict
    detail: str
    fetch: str  # `node.window.exchange.fetch`'s reason
    n_bytes: int = 0
    last_modified: str | None = None
    digest: str | None = None
    norm: float | None = None
    in_sync: bool | None = None
    peer_fingerprint: str | None = None
    selected: bool = False
    aggregated: bool = False
    closest: OverlapReport | None = None  # highest same-window index overlap with another peer
    copy_of: OverlapReport | None = None
    replay_of: OverlapReport | None = None
    loss: LossReport | None = None
    standing: StandingReport | None = None


class ScoreReport(_Model):
    run_id: str
    window: int
    validator_uid: int
    validator_hotkey: str
    fingerprint_start: str  # our model at the start of the window (= our fingerprint of w-1)
    fingerprint_end: str  # after applying the window's aggregate
    selected: list[int]
    aggregated: list[int]
    weights: dict[int, float]
    weights_status: str
    config: ValidatorConfig
    peers: list[PeerReport]


def _overlap(m: Match | None) -> OverlapReport | None:
    if m is None:
        return None
    return OverlapReport(other_uid=m.other_uid, other_window=m.other_window, overlap=m.overlap)


def _loss(s: LossScore | None) -> LossReport | None:
    if s is None:
        return None
    return LossReport(
        **dataclasses.asdict(s), score=s.score, own_gain=s.own_gain, indicator=s.indicator
    )


def _standing(book: Book, uid: int, weight: float) -> StandingReport | None:
    rec = book.records.get(uid)
    if rec is None:
        return None
    b = book.breakdown(uid)
    return StandingReport(
        mu=rec.mu, sigma=rec.sigma, ordinal=rec.ordinal, shifted_ordinal=b["shifted_ordinal"],
        indicator_ema=rec.indicator_ema, gain_ema=rec.gain_ema, sync_ema=rec.sync_ema,
        penalty=rec.penalty, gain_gate=b["gain_gate"], final=b["final"], weight=weight,
    )  # fmt: skip


def peer_report(
    c: PeerCheck, loss: LossScore | None, book: Book, selected: bool, applied: bool, weight: float
) -> PeerReport:
    up = c.upload
    return PeerReport(
        uid=c.uid,
        hotkey=c.hotkey,
        verdict=c.verdict,
        detail=c.detail,
        fetch=up.fetched.reason if up is not None else c.detail,
        n_bytes=up.fetched.n_bytes if up is not None else 0,
        last_modified=up.last_modified.isoformat() if up and up.last_modified else None,
        digest=up.fetched.update.digest.hex() if up and up.fetched.update else None,
        norm=c.norm,
        in_sync=c.in_sync,
        peer_fingerprint=up.fingerprint if up is not None else None,
        selected=selected,
        aggregated=applied,
        closest=_overlap(c.closest),
        copy_of=_overlap(c.copy_of),
        replay_of=_overlap(c.replay_of),
        loss=_loss(loss),
        standing=_standing(book, c.uid, weight),
    )


class WindowResult(BaseModel):
    """What the loop hands `build_report` besides the checks (keeps the call short)."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    run_id: str
    window: int
    validator_uid: int
    validator_hotkey: str
    fingerprint_start: str
    fingerprint_end: str
    selected: list[int]
    aggregated: list[int]
    weights: dict[int, float]
    weights_status: str
    config: ValidatorConfig


def build_report(
    result: WindowResult,
    checks: Mapping[int, PeerCheck],
    losses: Mapping[int, LossScore],
    book: Book,
) -> ScoreReport:
    peers = [
        peer_report(
            c,
            losses.get(uid),
            book,
            uid in result.selected,
            uid in result.aggregated,
            result.weights.get(uid, 0.0),
        )
        for uid, c in sorted(checks.items())
    ]
    return ScoreReport(**result.model_dump(), peers=peers)
