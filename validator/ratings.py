"""Per-peer standing across windows: OpenSkill rating, EMAs, penalties, and the final score.

State per peer (`PeerRecord`, reset when a uid changes hotkey):

* rating ``(μ, σ)``: OpenSkill Plackett–Luce, starting at the model defaults (μ0 = 25, σ0 = 25/3).
  Each window, the peers whose update passed every check and was scored are ranked by their
  score ``s`` (`validator.scoring`) and rated as one free-for-all game (skipped with < 2 peers);
  ``ordinal = μ - 3σ``;
* ``indicator_ema``: EMA of the own-data indicator (±1), start 0;
* ``gain_ema``: EMA of ``s``, start 0;
* ``sync_ema``: EMA of "its fingerprint for w-1 equals ours" (windows where it published none
  leave it unchanged), start 1;
* ``penalty`` p in [0, 1], start 0. A window with an offence of severity ``c`` (config:
  missing/unreachable 0.5, late 0.5, invalid/malformed/non-finite/norm outlier 1, copy/replay 1)
  sets ``p <- min(1, p + c)``; a clean window sets ``p <- ρ p`` (ρ = ``penalty_decay``, 0.5). One
  missed window halves the score, two in a row zero it; after that every clean window halves p,
  so a peer that behaves again is back above 90 % of its score after four windows.

Every EMA is ``x <- (1 - r) x + r x_new`` with ``r = ema_rate`` (0.3).

Final score of peer i::

    final_i = (ordinal_i - floor) * max(0, indicator_ema_i) * sync_ema_i * (1 - p_i) * [gain_ema_i > g]

``floor`` is the lowest ordinal among rated peers minus `FLOOR_MARGIN` (OpenSkill's default
σ), so the shifted ordinal is >= `FLOOR_MARGIN` > 0 for every rated peer: rank decides *how
much* an honest peer earns, while the gates (indicator, gain, penalty) decide *whether* it earns —
in a population of only honest peers the last-ranked one still earns. Unrated peers (never
scored) score 0. The gain gate ``[gain_ema > g]``, with
``g = max(0, GAIN_FRACTION * median gain_ema)``, zeroes a peer whose updates do not, on average,
lower the loss on random data by at least `GAIN_FRACTION` of the median rated peer's gain (a noise
uploader, whose gain is ~1 % of an honest one's) whatever its rank among few peers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from openskill.models import PlackettLuce
from pydantic import BaseModel, ConfigDict

from validator.checks import Verdict
from validator.config import ValidatorConfig

MODEL = PlackettLuce()
MU0, SIGMA0 = MODEL.mu, MODEL.sigma


FLOOR_MARGIN = 25.0 / 3.0
"""Base of the shifted ordinal: OpenSkill's default sigma."""

GAIN_FRACTION = 0.1
"""A peer earns only if its gain EMA exceeds this fraction of the median rated peer's."""


class PeerRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hotkey: str
    mu: float = MU0
    sigma: float = SIGMA0
    rated: bool = False
    indicator_ema: float = 0.0
    gain_ema: float = 0.0
    sync_ema: float = 1.0
    penalty: float = 0.0

    @property
    def ordinal(self) -> float:
        return self.mu - 3.0 * self.sigma


class WindowOutcome(BaseModel):
    """What one window said about one peer (the inputs of `Book.update`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hotkey: str
    verdict: Verdict
    in_sync: bool | None = None
    score: float | None = None  # s, when scored
    indicator: int | None = None


def severity(verdict: Verdict, cfg: ValidatorConfig) -> float:
    return {
        Verdict.OK: 0.0,
        Verdict.MISSING: cfg.penalty_missing,
        Verdict.UNREACHABLE: cfg.penalty_missing,
        Verdict.LATE: cfg.penalty_late,
        Verdict.INVALID: cfg.penalty_invalid,
        Verdict.MALFORMED: cfg.penalty_invalid,
        Verdict.NON_FINITE: cfg.penalty_invalid,
        Verdict.NORM_OUTLIER: cfg.penalty_invalid,
        Verdict.COPY: cfg.penalty_copy,
        Verdict.REPLAY: cfg.penalty_copy,
    }[verdict]


def _ema(old: float, new: float, rate: float) -> float:
    return (1.0 - rate) * old + rate * new


class Book:
    """Every peer's `PeerRecord`, updated once per window."""

    def __init__(self, cfg: ValidatorConfig, records: Mapping[int, PeerRecord] | None = None):
        self.cfg = cfg
        self.records: dict[int, PeerRecord] = dict(records or {})

    def update(self, outcomes: Mapping[int, WindowOutcome]) -> None:
        r = self.cfg.ema_rate
        for uid, o in outcomes.items():
            rec = self.records.get(uid)
            if rec is None or rec.hotkey != o.hotkey:  # new peer, or a recycled uid
                rec = self.records[uid] = PeerRecord(hotkey=o.hotkey)
            sev = severity(o.verdict, self.cfg)
            rec.penalty = (
                min(1.0, rec.penalty + sev) if sev > 0 else rec.penalty * (self.cfg.penalty_decay)
            )
            if o.in_sync is not None:
                rec.sync_ema = _ema(rec.sync_ema, 1.0 if o.in_sync else 0.0, r)
            if o.score is not None and o.indicator is not None:
                rec.indicator_ema = _ema(rec.indicator_ema, float(o.indicator), r)
                rec.gain_ema = _ema(rec.gain_ema, o.score, r)
        self._rate(
            {
                uid: o.score
                for uid, o in outcomes.items()
                if o.verdict is Verdict.OK and o.score is not None and math.isfinite(o.score)
            }
        )

    def _rate(self, scores: Mapping[int, float]) -> None:
        uids = sorted(scores)
        if len(uids) < 2:
            return
        teams = [[MODEL.rating(mu=self.records[u].mu, sigma=self.records[u].sigma)] for u in uids]
        rated = MODEL.rate(teams, scores=[scores[u] for u in uids])
        for uid, (new,) in zip(uids, rated, strict=True):
            rec = self.records[uid]
            rec.mu, rec.sigma, rec.rated = float(new.mu), float(new.sigma), True

    def floor(self) -> float:
        ords = [rec.ordinal for rec in self.records.values() if rec.rated]
        return min(ords) - FLOOR_MARGIN if ords else 0.0

    def gain_floor(self) -> float:
        """The gain a peer must beat to earn: `GAIN_FRACTION` of the median rated peer's gain EMA
        (and never below 0). Noise moves the loss by ~1 % of what an honest update does, so
        it stays under the bar even when its EMA drifts above zero by chance."""
        gains = sorted(rec.gain_ema for rec in self.records.values() if rec.rated)
        if not gains:
            return 0.0
        return max(0.0, GAIN_FRACTION * gains[len(gains) // 2])

    def breakdown(self, uid: int) -> dict[str, float]:
        """Every factor of the final score of `uid` (all zero for an unknown uid)."""
        rec = self.records.get(uid)
        if rec is None:
            return {"ordinal": 0.0, "shifted_ordinal": 0.0, "final": 0.0}
        shifted = max(0.0, rec.ordinal - self.floor()) if rec.rated else 0.0
        gate = 1.0 if rec.gain_ema > self.gain_floor() else 0.0
        final = shifted * max(0.0, rec.indicator_ema) * rec.sync_ema * (1.0 - rec.penalty) * gate
        return {
            "ordinal": rec.ordinal,
            "shifted_ordinal": shifted,
            "indicator_factor": max(0.0, rec.indicator_ema),
            "sync_factor": rec.sync_ema,
            "penalty_factor": 1.0 - rec.penalty,
            "gain_gate": gate,
            "final": final,
        }

    def final_scores(self, uids: list[int] | None = None) -> dict[int, float]:
        keys = sorted(self.records) if uids is None else uids
        return {uid: self.breakdown(uid)["final"] for uid in keys}
