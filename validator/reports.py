"""The per-window score report the validator publishes (`protocol.naming.scores_key`).

Everything that went into every peer's score is in it, so anyone holding the same model (the
published checkpoints and aggregates) can recompute the loss scores, the ratings and the weights:
the window's revealed sample secret (`samples`, checked by `verify_report_samples`), every loss
and statistic, and every factor of the final score.

Each peer's ``rule`` names what decided its weight, first match wins (``rules`` lists every rule
that lowered it):

* this window's verdict when it is not ``ok``: ``missing``, ``unreachable``, ``late``,
  ``invalid``, ``malformed``, ``non_finite``, ``norm_outlier``, ``copy``, ``replay``;
* ``penalty`` (earlier offences: p = 1), ``unscored`` (no window has scored the peer yet),
  ``gain gate`` (gain EMA under the gate), ``indicator`` (pooled own-data statistic at or under
  ``own_z_low``), ``effect`` (no own-data effect), ``out of sync`` (sync EMA 0);
* for a peer that earns: ``indicator (partial)``, ``norm band`` (this window's norm outside the
  band cut its score), ``effect (partial)`` (an own-data effect below ``effect_full`` of an
  honest one's), ``penalty (decaying)``, ``sync (partial)``, else ``ok``.
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from node.data.dataset import Dataset
from protocol.runconfig import RunConfig
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.copies import Explained, Match
from validator.ratings import Book
from validator.reveal import (
    CommitRecord,
    RevealError,
    SampleReveal,
    verify_commit_record,
    verify_own_slots,
    verify_reveal,
)
from validator.scoring import LossScore


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OverlapReport(_Model):
    other_uid: int
    other_window: int
    overlap: float


class DerivationReport(_Model):
    share: float  # R² of the update on its sources, at its own positions
    sources: list[tuple[int, int]]  # (uid, window); uid -1: that window's applied aggregate


class ExplainedReport(_Model):
    window: DerivationReport  # by this window's earlier uploads (copy rule)
    history: DerivationReport  # by the closest earlier update or aggregate (replay rule)


class LossReport(_Model):
    loss_before_random: float
    loss_after_random: float
    loss_before_own: float
    loss_after_own: float
    n_random: int
    n_own: int
    norm: float
    target_norm: float  # T: the median norm of the window's accepted updates
    norm_factor: float  # q: 1 inside the norm band
    direction_score: float  # s at the common step, before q
    score: float  # s
    own_gain: float
    own_z: float
    own_diff: float
    own_se: float
    own_method: str
    indicator: int
    own_slots: list[int]


class StandingReport(_Model):
    """The peer's record after this window, and the factors of its final score."""

    mu: float
    sigma: float
    ordinal: float  # information only: pay does not depend on it (`validator.ratings`)
    own_z: list[float]  # the last windows' own-data statistics
    own_pooled: float  # Z = Σ z / sqrt(n)
    indicator_factor: float
    effect_factor: float  # the own-data effect's share of an honest one's (`validator.ratings`)
    gain: float  # the bias-corrected EMA of the relative score (`validator.ratings`)
    sync_ema: float
    penalty: float
    gain_gate: float
    final: float
    weight: float


class PeerReport(_Model):
    uid: int
    hotkey: str
    verdict: Verdict
    rule: str  # what decided the weight (module docstring)
    rules: list[str]  # every rule that lowered it
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
    explained: ExplainedReport | None = None  # `validator.copies.explain`: copy / replay evidence
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
    samples: SampleReveal | None = None  # the window's revealed secret (None: nothing scored)
    peers: list[PeerReport]


def _overlap(m: Match | None) -> OverlapReport | None:
    if m is None:
        return None
    return OverlapReport(other_uid=m.other_uid, other_window=m.other_window, overlap=m.overlap)


def _explained(e: Explained | None) -> ExplainedReport | None:
    if e is None:
        return None
    window, history = (
        DerivationReport(share=d.share, sources=list(d.sources)) for d in (e.window, e.history)
    )
    return ExplainedReport(window=window, history=history)


def _loss(s: LossScore | None) -> LossReport | None:
    if s is None:
        return None
    return LossReport(
        loss_before_random=s.loss_before_random, loss_after_random=s.loss_after_random,
        loss_before_own=s.loss_before_own, loss_after_own=s.loss_after_own,
        n_random=s.n_random, n_own=s.n_own, norm=s.norm, target_norm=s.target_norm,
        norm_factor=s.norm_factor, direction_score=s.direction_score, score=s.score,
        own_gain=s.own_gain, own_z=s.own.z, own_diff=s.own.diff, own_se=s.own.se,
        own_method=s.own.method, indicator=s.indicator,
        own_slots=list(s.own_slots),
    )  # fmt: skip


def _standing(book: Book, uid: int, weight: float) -> StandingReport | None:
    rec = book.records.get(uid)
    if rec is None:
        return None
    b = book.breakdown(uid)
    return StandingReport(
        mu=rec.mu, sigma=rec.sigma, ordinal=rec.ordinal, own_z=rec.own_z, own_pooled=rec.own_pooled,
        indicator_factor=b["indicator_factor"], effect_factor=b["effect_factor"],
        gain=book.gain(rec), sync_ema=rec.sync_ema,
        penalty=rec.penalty, gain_gate=b["gain_gate"], final=b["final"], weight=weight,
    )  # fmt: skip


def weight_rules(verdict: Verdict, loss: LossScore | None, book: Book, uid: int) -> list[str]:
    """Every rule that lowered the peer's weight this window, the decisive one first."""
    rules = [] if verdict is Verdict.OK else [verdict.value]
    rec = book.records.get(uid)
    if rec is None:
        return rules or ["unscored"]
    b = book.breakdown(uid)
    # a peer no window has scored has no evidence, so the rules that wait for evidence
    # (its gain, its own-data statistic and effect) say only that
    evidence = [("gain gate", b["gain_gate"]), ("indicator", b["indicator_factor"]),
                ("effect", b["effect_factor"])] if rec.scored else [("unscored", 0.0)]  # fmt: skip
    zeroing = [
        ("penalty", b["penalty_factor"]), *evidence, ("out of sync", b["sync_factor"]),
    ]  # fmt: skip
    rules += [name for name, factor in zeroing if factor <= 0.0]
    partial = [
        ("indicator (partial)", b["indicator_factor"]),
        ("norm band", loss.norm_factor if loss is not None else 1.0),
        ("effect (partial)", b["effect_factor"]),
        ("penalty (decaying)", b["penalty_factor"]), ("sync (partial)", b["sync_factor"]),
    ]  # fmt: skip
    rules += [name for name, factor in partial if 0.0 < factor < 1.0]
    return rules or ["ok"]


def peer_report(
    c: PeerCheck, loss: LossScore | None, book: Book, selected: bool, applied: bool, weight: float
) -> PeerReport:
    up = c.upload
    rules = weight_rules(c.verdict, loss, book, c.uid)
    return PeerReport(
        uid=c.uid,
        hotkey=c.hotkey,
        verdict=c.verdict,
        rule=rules[0],
        rules=rules,
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
        explained=_explained(c.explained),
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
    samples: SampleReveal | None = None


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


def verify_report_samples(
    report: ScoreReport, dataset: Dataset, run: RunConfig, record: CommitRecord | None = None
) -> dict[int, list[int]]:
    """Recompute every sample a published report scored on, from its revealed secret; returns the
    own slots by uid. Raises `RevealError` when the secret does not match its commitment (the
    one in `record`, the signed `CommitRecord` published before the window, when given) or when
    any listed slot does not follow from it."""
    if report.samples is None:
        if any(p.loss is not None for p in report.peers):
            raise RevealError(f"window {report.window}: losses without a revealed secret")
        return {}
    if record is not None:
        verify_commit_record(record)
        if (record.run_id, record.window, record.validator_hotkey) != (
            report.run_id, report.window, report.validator_hotkey,
        ):  # fmt: skip
            raise RevealError(f"window {report.window}: the commitment is for another window")
    commit = record.commit if record is not None else None
    verify_reveal(report.samples, dataset, report.run_id, report.window, commit)
    out: dict[int, list[int]] = {}
    for peer in report.peers:
        if peer.loss is not None:
            verify_own_slots(
                report.samples, dataset, run, report.window, peer.uid, peer.loss.own_slots
            )
            out[peer.uid] = peer.loss.own_slots
    return out
