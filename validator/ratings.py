"""Per-peer standing across windows: EMAs, penalties, an OpenSkill rating, and the final score.

State per peer (`PeerRecord`, reset when a uid changes hotkey):

* ``gain_ema``: EMA of the window's relative score ``s / m`` (``s``: `validator.scoring`, the
  relative improvement on random data at the common, norm-fair step; ``m``: the window's
  reference, below), start 0, read bias-corrected (``gain``: divided by ``1 - (1 - r)^n`` after
  ``n`` scored windows, so that it does not depend on how many windows scored the peer);
* ``own_z``: the own-data statistics ``z_t`` (`validator.scoring`, clipped to
  [`Z_CLIP_LOW`, `Z_CLIP_HIGH`]) of the peer's last ``own_windows`` (6) scored windows, and their
  pooled value ``Z = Σ z_t / sqrt(n)`` (Stouffer);
* ``effect_ema``: EMA of the window's relative own-data effect ``e = d / m_d`` (``d``: the
  own-data effect `validator.scoring.OwnTest.diff`; ``m_d``: its upper quartile over the same
  reference peers as ``m``), each window's ``e`` clipped to [`EFFECT_CLIP_LOW`,
  `EFFECT_CLIP_HIGH`], start 0, read bias-corrected like the gain;
* ``sync_ema``: EMA of "its fingerprint for w-1 equals ours" (windows where it published none
  leave it unchanged), start 1;
* ``penalty`` p in [0, 1], start 0. A window with an offence of severity ``c`` (config:
  missing/unreachable 0.5, late 0.5, invalid/malformed/non-finite/norm outlier 1, copy/replay 1)
  sets ``p <- min(1, p + c)``; a clean window sets ``p <- ρ p`` (ρ = ``penalty_decay``, 0.5). One
  missed window halves the score, two in a row zero it; after that every clean window halves p,
  so a peer that behaves again is back above 90 % of its score after four windows. A late or
  missing verdict in a window in which the validator saw the chain down leaves p as it was
  (`EXCUSABLE`, `node.runtime.resilient_chain.chain_was_down`);
* rating ``(μ, σ)``: OpenSkill Plackett–Luce over the window's ``s`` ranking (peers whose update
  passed every check; skipped with < 2 peers), reported as ``ordinal = μ - 3σ``. It is
  information only (see below).

Every EMA is ``x <- (1 - r) x + r x_new`` with ``r = ema_rate`` (0.3).

Final score of peer i::

    final_i  = max(0, gain_i) * effect_i * own_i * sync_ema_i * (1 - p_i) * [gain_i > g]
    effect_i = clip(effect_ema_i / effect_full, 0, 1)
    own_i    = clip((Z_i - own_z_low) / (own_z_full - own_z_low), 0, 1)

**Why the own-data effect, and not only its significance.** The gain is measured at a common
step, so it says how good an update's direction is, not how much training went into it: three
pieces of one update (disjoint supports, one training spread over three hotkeys' assignments)
each keep most of the direction's quality (gains 0.73, 0.56, 0.32 of an honest update's) and,
with evidence pooled over windows, each passed the significance ramp: together 1.29 honest
pays for one training. How much a peer trained on its own samples shows in the size of the own-data
effect: the pieces showed 0.35, 0.20 and 0.11 of an honest effect, an update trained on
reversed tokens 0.4–0.5, honest ones 0.80–1.17 (three windows' secrets, `tiny`,
`tests/unit/test_pay_for_work.py`). Pay scales with the effect up to ``effect_full`` (0.8) of the
window's upper quartile (an honest update's effect is the top of the range, whatever the number
of pieces and garbage below it), so honest peers are paid in full (0.96–1.05 of their mean) and
the three pieces together 0.40 of one honest pay (`scripts/experiments/pay_for_work.py`).

**Why the gain and not the rank.** Pay linear in the OpenSkill ordinal (shifted to the lowest
rated peer) splits peers doing identical work by ±40–60 % in every window (synthetic equal
peers, 3–4 of them, windows 3–12): the ranking among equals is a coin toss each window, and
OpenSkill turns it into persistent ordinal gaps of 8–16 points. The gain EMA of equal peers
differs by the noise of ``s`` averaged over ~6 windows (a few percent), and a scaled update
cannot raise it (`validator.scoring` probes every update at the same norm).

**Why relative to the window.** ``s`` shrinks as training goes on (a tenfold drop over the
first windows of `tiny`), and a validator that runs out of time leaves a different few peers
unscored each window (`validator.scoring.pick_scored`). With the raw ``s`` in the EMA, a peer
skipped in an early window kept a low EMA and one skipped late a high one: ±23 % between equal
peers in `tessera sim --adversaries mixer,scaled,recycler,copier,stale,freeloader`. The EMA
takes ``s / m`` instead, where ``m`` is the median ``s`` of the window's scored, accepted peers
whose own-data evidence already earns (`Book.consensus`: all accepted ones while fewer than two
do), so equal work has the same expected value in every window whichever windows it was scored
in. Noise, copies and freeloaders carry no own-data evidence and so do not move ``m``; when
``m`` is not positive, the window leaves every gain EMA as it was. The EMA starts at 0, so it
is read bias-corrected (``gain_i``, as Adam corrects its moments): otherwise a peer skipped once
during the warm-up would trail its equals for the next ten windows.

**Why a pooled statistic.** One window's own-data test is noisy: the old factor
``max(0, EMA(±1))`` cut an honest peer's pay tenfold when its indicator came out −1 on a
difference of 5e-6. A null update (a copy the index and value rules missed, a recycled or
random update: nothing trained on the peer's own samples) has ``z_t ~ N(0, 1)`` in every window,
so its pooled ``Z`` is N(0, 1) however many windows are pooled, and it earns only when
``Z > own_z_low`` (3.5): a chance of 2.3e-4 per window. An honest peer's ``z_t`` has mean
``μ`` (measured in `scripts/experiments/validator_fairness.py`), so ``Z`` grows like ``μ sqrt(n)``: one
window with no evidence at all costs it nothing once a few windows are pooled, and the
measured false-negative rate (partial pay after the warm-up) is in docs/results.md. The clip keeps
one extreme window from carrying the pool.

The gain gate ``[gain_i > g]``, with ``g = max(0, GAIN_FRACTION * median gain)`` over rated
peers, zeroes a peer whose updates do not, on average, lower the loss on random data by at least
`GAIN_FRACTION` of the median rated peer's gain: a noise uploader (~1 % of an honest gain) or a
freeloader (an all-zero update: exactly 0), whatever its evidence.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING

from openskill.models import PlackettLuce
from pydantic import BaseModel, ConfigDict

from validator.checks import Verdict
from validator.config import ValidatorConfig

if TYPE_CHECKING:  # the checks' and the probe's results, read here
    from validator.classify import PeerCheck
    from validator.scoring import LossScore

MODEL = PlackettLuce()
MU0, SIGMA0 = MODEL.mu, MODEL.sigma

GAIN_FRACTION = 0.1
"""A peer earns only if its gain EMA exceeds this fraction of the median rated peer's."""
Z_CLIP_LOW, Z_CLIP_HIGH = -4.0, 6.0
"""One window's own-data statistic counts within these bounds."""
EFFECT_CLIP_LOW, EFFECT_CLIP_HIGH = -1.0, 2.0
"""One window's relative own-data effect counts within these bounds."""


class PeerRecord(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hotkey: str
    mu: float = MU0
    sigma: float = SIGMA0
    rated: bool = False
    own_z: list[float] = []
    gain_ema: float = 0.0
    gain_windows: int = 0  # windows that updated `gain_ema`
    effect_ema: float = 0.0
    effect_windows: int = 0  # windows that updated `effect_ema`
    sync_ema: float = 1.0
    penalty: float = 0.0

    @property
    def ordinal(self) -> float:
        return self.mu - 3.0 * self.sigma

    @property
    def scored(self) -> bool:
        """Whether any window has scored this peer yet (a record is kept from its first
        verdict on, scored or not)."""
        return self.rated or bool(self.own_z) or self.gain_windows > 0

    @property
    def own_pooled(self) -> float:
        """``Z = Σ z_t / sqrt(n)`` over the recorded windows (0 with none)."""
        return sum(self.own_z) / math.sqrt(len(self.own_z)) if self.own_z else 0.0


class WindowOutcome(BaseModel):
    """What one window said about one peer (the inputs of `Book.update`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hotkey: str
    verdict: Verdict
    in_sync: bool | None = None
    score: float | None = None  # s, when scored
    own_z: float | None = None  # the window's own-data statistic, when scored
    own_effect: float | None = None  # the window's own-data effect, when scored
    applied: bool = False  # in the window's applied set


def window_outcomes(
    checks: Mapping[int, PeerCheck], losses: Mapping[int, LossScore], applied: Collection[int]
) -> dict[int, WindowOutcome]:
    """Each checked peer's outcome of the window: its verdict, its score where it was scored."""
    return {
        uid: WindowOutcome(
            hotkey=c.hotkey,
            verdict=c.verdict,
            in_sync=c.in_sync,
            score=losses[uid].score if uid in losses else None,
            own_z=losses[uid].own.z if uid in losses else None,
            own_effect=losses[uid].own.diff if uid in losses else None,
            applied=uid in applied,
        )
        for uid, c in checks.items()
    }


EXCUSABLE = frozenset({Verdict.LATE, Verdict.MISSING})
"""Verdicts that a chain outage while the window ran excuses: every honest node reads the clock
and waits for the decision before it from the chain, so an outage makes honest peers late or
absent (a late or absent update earns nothing in that window either way)."""


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
        Verdict.EQUIVOCATION: cfg.penalty_copy,
    }[verdict]


def upper_quartile(values: list[float]) -> float | None:
    """The upper quartile of `values` (the smallest at or above three quarters of them); None
    unless positive. The effect of an honest update is the top of the window's range: partial
    work, split pieces and garbage all show less, so their number does not lower it."""
    if not values:
        return None
    ranked = sorted(values)
    q = ranked[math.ceil(0.75 * len(ranked)) - 1]
    return q if q > 0 else None


def _ema(old: float, new: float, rate: float) -> float:
    return (1.0 - rate) * old + rate * new


class Book:
    """Every peer's `PeerRecord`, updated once per window."""

    def __init__(
        self, cfg: ValidatorConfig, records: Mapping[int, PeerRecord] | None = None
    ) -> None:
        self.cfg = cfg
        self.records: dict[int, PeerRecord] = dict(records or {})

    def update(self, outcomes: Mapping[int, WindowOutcome], chain_was_down: bool = False) -> None:
        """One window's outcomes into the records; `chain_was_down`: the chain failed us while
        the window ran, so its `EXCUSABLE` verdicts leave the penalty as it was."""
        r = self.cfg.ema_rate
        scores = {
            uid: o.score
            for uid, o in outcomes.items()
            if o.verdict is Verdict.OK and o.score is not None and math.isfinite(o.score)
        }
        applied = {u for u in scores if outcomes[u].applied}
        hotkeys = {u: outcomes[u].hotkey for u in scores}
        reference = self.reference(hotkeys, scores, applied)
        effects = {
            u: e for u in scores if (e := outcomes[u].own_effect) is not None and math.isfinite(e)
        }
        members = self.consensus({u: hotkeys[u] for u in effects}, applied)
        effect_ref = upper_quartile([effects[u] for u in members])
        for uid, o in outcomes.items():
            rec = self.records.get(uid)
            if rec is None or rec.hotkey != o.hotkey:  # new peer, or a recycled uid
                rec = self.records[uid] = PeerRecord(hotkey=o.hotkey)
            sev = severity(o.verdict, self.cfg)
            if not (chain_was_down and o.verdict in EXCUSABLE):
                rec.penalty = (
                    min(1.0, rec.penalty + sev) if sev > 0 else rec.penalty * self.cfg.penalty_decay
                )
            if o.in_sync is not None:
                rec.sync_ema = _ema(rec.sync_ema, 1.0 if o.in_sync else 0.0, r)
            if o.score is not None and o.own_z is not None and math.isfinite(o.score):
                z = min(Z_CLIP_HIGH, max(Z_CLIP_LOW, o.own_z)) if math.isfinite(o.own_z) else 0.0
                rec.own_z = [*rec.own_z, z][-self.cfg.own_windows :]
                if reference is not None:
                    rec.gain_ema = _ema(rec.gain_ema, o.score / reference, r)
                    rec.gain_windows += 1
                if effect_ref is not None and uid in effects:
                    e = min(EFFECT_CLIP_HIGH, max(EFFECT_CLIP_LOW, effects[uid] / effect_ref))
                    rec.effect_ema = _ema(rec.effect_ema, e, r)
                    rec.effect_windows += 1
        self._rate(scores)

    def reference(
        self,
        hotkeys: Mapping[int, str],
        scores: Mapping[int, float],
        applied: Collection[int] = (),
    ) -> float | None:
        """The window's ``m``: the median score of the accepted peers `hotkeys` in `consensus`
        (evaluated before this window's evidence is added; the `applied` ones while fewer than
        two have evidence that earns); None unless positive."""
        members = [scores[u] for u in self.consensus(hotkeys, applied)]
        if not members:
            return None
        mid = statistics.median(members)
        return mid if mid > 0 else None

    def _rate(self, scores: Mapping[int, float]) -> None:
        uids = sorted(scores)
        if len(uids) < 2:
            return
        teams = [[MODEL.rating(mu=self.records[u].mu, sigma=self.records[u].sigma)] for u in uids]
        rated = MODEL.rate(teams, scores=[scores[u] for u in uids])
        for uid, (new,) in zip(uids, rated, strict=True):
            rec = self.records[uid]
            rec.mu, rec.sigma, rec.rated = float(new.mu), float(new.sigma), True

    def gain_floor(self) -> float:
        """The gain a peer must beat to earn: `GAIN_FRACTION` of the median rated peer's gain EMA
        (and never below 0). Noise moves the loss by ~1 % of what an honest update does, so
        it stays under the bar even when its EMA drifts above zero by chance."""
        gains = sorted(self.gain(rec) for rec in self.records.values() if rec.rated)
        if not gains:
            return 0.0
        return max(0.0, GAIN_FRACTION * gains[len(gains) // 2])

    def consensus(self, hotkeys: Mapping[int, str], applied: Collection[int] = ()) -> set[int]:
        """Of the peers `hotkeys` (uid -> hotkey, this window's accepted updates), those whose
        own-data evidence already earns (`own_factor` > 0): their mean direction is the own-data
        test's covariate (`validator.scoring`). While fewer than two qualify: those of them the
        window `applied` (which showed training this window, `validator.admission`), or all of
        them when it applied none: a crowd of null updates at launch never sets ``m``."""
        known = self.earning(hotkeys)
        if not self._launching(known):
            return known
        shown = {u for u in hotkeys if u in applied}
        return shown or set(hotkeys)

    def launching(self, hotkeys: Mapping[int, str]) -> bool:
        """Whether fewer than two of the peers `hotkeys` earn: no consensus of earning peers yet
        (the run's first windows)."""
        return self._launching(self.earning(hotkeys))

    @staticmethod
    def _launching(earning: Collection[int]) -> bool:
        return len(earning) < 2

    def earning(self, hotkeys: Mapping[int, str]) -> set[int]:
        """Of the peers `hotkeys` (uid -> hotkey), those whose own-data evidence earns."""
        return {
            u for u, hk in hotkeys.items()
            if (rec := self.records.get(u)) is not None and rec.hotkey == hk
            and self.own_factor(rec) > 0
        }  # fmt: skip

    def gain(self, rec: PeerRecord) -> float:
        """The bias-corrected gain EMA: equal relative scores give equal gains however many
        windows scored each peer (a validator out of time skips a different few each window)."""
        return self._corrected(rec.gain_ema, rec.gain_windows)

    def effect_factor(self, rec: PeerRecord) -> float:
        """``effect_i``: the bias-corrected effect EMA over ``effect_full``, within [0, 1]."""
        effect = self._corrected(rec.effect_ema, rec.effect_windows)
        return min(1.0, max(0.0, effect / self.cfg.effect_full))

    def _corrected(self, ema: float, windows: int) -> float:
        return ema if windows == 0 else ema / (1.0 - (1.0 - self.cfg.ema_rate) ** windows)

    def own_factor(self, rec: PeerRecord) -> float:
        """``own_i``: the ramp of the pooled own-data statistic between low (0) and full (1)."""
        lo, hi = self.cfg.own_z_low, self.cfg.own_z_full
        return min(1.0, max(0.0, (rec.own_pooled - lo) / (hi - lo)))

    def breakdown(self, uid: int) -> dict[str, float]:
        """Every factor of the final score of `uid` (all zero for an unknown uid)."""
        rec = self.records.get(uid)
        if rec is None:
            return {"ordinal": 0.0, "gain_factor": 0.0, "final": 0.0}
        corrected = self.gain(rec)
        gain = max(0.0, corrected)
        gate = 1.0 if corrected > self.gain_floor() else 0.0
        own = self.own_factor(rec)
        effect = self.effect_factor(rec)
        final = gain * effect * own * rec.sync_ema * (1.0 - rec.penalty) * gate
        return {
            "ordinal": rec.ordinal,
            "gain_factor": gain,
            "effect_factor": effect,
            "indicator_factor": own,
            "sync_factor": rec.sync_ema,
            "penalty_factor": 1.0 - rec.penalty,
            "gain_gate": gate,
            "final": final,
        }

    def final_scores(self, uids: list[int] | None = None) -> dict[int, float]:
        keys = sorted(self.records) if uids is None else uids
        return {uid: self.breakdown(uid)["final"] for uid in keys}
