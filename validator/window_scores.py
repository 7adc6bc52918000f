"""One window's loss scores (`validator.scoring`), taken in two parts: the lead's evidence on its
selected updates before it decides (`validator.admission`, each probed at its own norm), every
update's score at the applied set's ``T`` after the agreement, each part until its own deadline.
One probe serves both, and an update whose norm is within `REUSE_SPREAD` of ``T`` is probed
once."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace

import torch

from node.data.dataset import Dataset
from node.model.losses import OutOfTime
from node.strategy.format import UpdateFormat
from node.window.gather import Pieces
from protocol.runconfig import RunConfig
from protocol.stores.spool import SpoolError
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.config import ValidatorConfig
from validator.probe_start import ProbeStart
from validator.ratings import Book
from validator.reveal import SampleReveal
from validator.scoring import (
    REUSE_SPREAD,
    LossProbe,
    LossScore,
    pick_scored,
    reference_norm,
    scored_after_agreement,
)

log = logging.getLogger(f"tessera.{__name__}")

SCORABLE = {Verdict.OK, Verdict.COPY, Verdict.REPLAY}
"""Verdicts whose updates are scored (copies and replays for the report only)."""


class WindowScorer:
    """The probe of one window and the scores it has taken so far."""

    def __init__(
        self,
        model: torch.nn.Module,
        run: RunConfig,
        dataset: Dataset,
        window: int,
        reveal: SampleReveal,
        checks: Mapping[int, PeerCheck],
        book: Book,
        cfg: ValidatorConfig,
        device: torch.device,
        fmt: UpdateFormat,
        previous: Mapping[str, torch.Tensor] | None = None,
        start: ProbeStart | None = None,
    ) -> None:
        self.window, self.checks, self.cfg = window, checks, cfg
        self.fetched = Pieces(
            {
                u: c.upload.fetched.update
                for u, c in checks.items()
                if c.upload and c.upload.fetched.update is not None
            }
        )
        self.accepted = [u for u in self.fetched if _finite_ok(checks[u])]
        hotkeys = {u: checks[u].hotkey for u in self.accepted}
        consensus = book.consensus(hotkeys)
        self.earning = book.earning(hotkeys)
        # until two peers earn, the previous window's step is a second covariate
        launch = previous is not None and book.launching(hotkeys)
        candidates = [u for u, c in checks.items() if c.verdict in SCORABLE and u in self.fetched]
        # the accepted first, in an order drawn each window (the lead's evidence takes the
        # selected ones in the same draw, `validator.admission.probe_order`); the scores after
        # the agreement the applied ones and then the others, at most `cap` in all
        self.draw = pick_scored(run.run_id, window, candidates, 0, set(self.accepted))
        self.cap = cfg.scored_per_window(run.gather_size)
        norms = {u: checks[u].norm for u in self.accepted}
        begun = time.monotonic()
        self.probe = LossProbe(
            model, run, dataset, window, reveal, self.fetched.only(consensus),
            norms, cfg, device, fmt, previous if launch else None, start,  # type: ignore[arg-type]
        )  # fmt: skip
        self.setup_s = time.monotonic() - begun
        # how long one score takes, before the first: the setup runs about as many forward
        # passes as one score, unless the start's passes were taken before the gather; a score
        # runs at least two passes the size of the random samples' one
        self.first_estimate_s = max(self.setup_s, 2 * self.probe.base.pass_s)
        self.evidence: dict[int, LossScore | None] = {}  # probed at their own norm

    def own_norm_score(self, uid: int, until: float = math.inf) -> LossScore | None:
        """`uid`'s update probed at its own norm (taken once); None when that failed, or when
        `until` (monotonic seconds) passed before the probe's last forward pass (then it is
        stopped there, the model restored, and nothing kept: a later call probes again)."""
        if uid not in self.evidence:
            norm = self.checks[uid].norm or 0.0
            try:
                with self._stopping_at(until):
                    self.evidence[uid] = self._probe(uid, norm)
            except OutOfTime:
                return None
        return self.evidence[uid]

    @contextmanager
    def _stopping_at(self, until: float) -> Iterator[None]:
        """The probe's forward passes stop (`OutOfTime`) once `until` (monotonic seconds) has
        passed."""
        self.probe.stop = lambda: time.monotonic() > until
        try:
            yield
        finally:
            self.probe.stop = None

    def rest(self, until: float, applied: Sequence[int]) -> dict[int, LossScore]:
        """Every update still scorable (after the norm verdicts) scored at ``T``, the lower
        median norm of the `applied` ones: those that need a probe until `until` (monotonic
        seconds; a probe still running then stops before its next forward pass), those whose
        probe at their own norm stands for it (`REUSE_SPREAD`) always."""
        norms = {u: self.checks[u].norm for u in applied if u in self.checks}
        target = reference_norm({u: n for u, n in norms.items() if n is not None})
        scorable = [u for u in self.draw if self.checks[u].verdict in SCORABLE]
        order = scored_after_agreement(scorable, applied, self.earning, self.cap)
        out: dict[int, LossScore] = {}
        late = 0
        for uid in order:
            norm = self.checks[uid].norm or 0.0
            own = self.evidence.get(uid)
            if own is not None and target > 0 and abs(norm / target - 1) <= REUSE_SPREAD:
                out[uid] = replace(own, target_norm=target)  # no forward pass: taken even late
                continue
            if time.monotonic() > until:
                late += 1
                continue
            try:
                with self._stopping_at(until):  # a probe still running then stops too
                    score = self._probe(uid, norm, target)
            except OutOfTime:
                late += 1
                continue
            if score is not None:
                out[uid] = score
        if late:
            log.warning("window %d: out of time, %d peers left unscored", self.window, late)
        return out

    def _probe(self, uid: int, norm: float, target: float | None = None) -> LossScore | None:
        try:  # one decoded update at a time (the probe's reference shares it)
            at = norm if target is None else target
            return self.probe.score(uid, self.fetched[uid], norm, at)
        except (SpoolError, OutOfTime):
            raise  # ours, not the peer's
        except Exception:  # one bad peer never stops the window
            log.exception("window %d: scoring uid %d failed", self.window, uid)
            return None


def _finite_ok(check: PeerCheck) -> bool:
    return check.ok and check.norm is not None and math.isfinite(check.norm)
