"""LossScore: how much one peer's update helps the validator's current model, at a common step size.

For window ``w`` the validator holds ``θ``, the model at the start of ``w`` (the weights every
peer's update of ``w`` was computed against). The samples come from the window's revealed secret
(`validator.reveal`): ``R``, ``n_random`` random training slots (the same for every peer), and
``O_i``, ``n_own`` of the slots assigned to peer ``i`` for ``w``; nobody knows either set before
the upload deadline.

**Norm-fair step.** ``T`` is the lower median norm of the updates the window applies (the outer
step's clip bound; `reference_norm`). Every update ``Δ̂_i`` (norm ``n_i``) is probed at the same
step length::

    θ_i' = θ - η (T / n_i) Δ̂_i,    η = score_scale * α

so only its direction counts: ``c·Δ̂`` gives the same probe as ``Δ̂`` for any ``c > 0`` (up to
float rounding). Per sample ``x``, ``g_i(x) = (L(θ; x) - L(θ_i'; x)) / mean L(θ; batch)``.

* direction score ``s_dir = mean_R g_i`` (relative improvement on random data);
* the norm is judged separately: with ``r = n_i / T`` and ``b = norm_band`` (2), the score is
  ``s = q s_dir`` when ``s_dir >= 0`` and ``s = (2 - q) s_dir`` otherwise, where
  ``q = min(1, b min(r, 1/r))``. Honest norms are within a few percent of the median (measured
  max/median < 1.01 in `scripts/experiments/validator_separation.py`), so ``q = 1`` for them; an update
  scaled by ``c`` outside ``[1/b, b]`` loses score (``q = 0.4`` at ``c = 5`` or ``0.2``). Hence
  **scaling never raises a score or a rank**: inside the band it changes nothing, outside it
  only lowers ``s``. (The outer step clips every update to the median norm anyway.)

**Before the agreement** the lead needs the own-data test of the selected updates
(`validator.admission`) and no ``T`` exists yet: a ``T`` from all uploads would be the crowd's to
set (a majority of tiny updates shrinks the probe of an honest one into float rounding). Those
updates are probed at their own norm (``T = n_i``), which depends on each update alone; the
score at the common ``T`` reuses that probe when ``n_i`` is within `REUSE_SPREAD` of ``T``
(honest updates, all but always) and probes again otherwise.

**Own-data test.** An honest update fits its own samples better than random ones; a copied,
replayed, recycled or random update has no reason to. The test compares ``g_i`` on ``O_i`` with
``g_i`` on ``R`` by a regression (ANCOVA) ``g = a + b [x in O_i] + θ c(x) + ε`` whose covariate
``c(x)`` is the gain of the *other* accepted updates' mean direction on the same sample (the
leave-one-out consensus, `LossProbe`): most of a sample's gain is shared by every update
(correlation ~0.86), so removing it shrinks the standard error about twofold (honest z 4.4 vs
2.4 for a plain Welch test on the same 64 + 64 samples, measured). ``own_z = b / SE(b)``. Until
two peers have earned, the consensus is the window's accepted updates, which a crowd can dilute,
and the gain of the previous window's outer step is a second covariate (correlation ~0.82;
`scripts/experiments/bootstrap_covariate.py`), which it cannot. The first window has no previous
step; with fewer than two accepted updates there and no covariate, the test is Welch's. Per
window:

    indicator = +1 if own_z >= own_z_pass (2) else -1       (information: the report's pass/fail)

A null update (nothing trained on ``O_i``) has ``own_z ~ N(0, 1)``: it passes 0.1 % of windows.
Honest false negatives and the pay rule built on ``e`` are in `validator.ratings`;
`scripts/experiments/validator_separation.py` measures both.

``L`` is `miner.train.lm_loss`'s next-token cross-entropy, per sample, without gradients.
The probe runs on the validator's model and restores it bit for bit after every step.
"""

from __future__ import annotations

import hashlib
import math
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from node.data.dataset import Dataset
from node.strategy.format import UpdateFormat
from protocol.runconfig import RunConfig
from validator.config import ValidatorConfig
from validator.probe_start import ProbeStart, Update
from validator.probe_state import zeros_on
from validator.reveal import SampleReveal


@dataclass(frozen=True)
class OwnTest:
    """The own-data statistic of one update: ``z = diff / se``."""

    z: float
    diff: float  # estimated own-data advantage (relative gain, adjusted for the covariate)
    se: float
    method: str  # "ancova" | "welch"


@dataclass(frozen=True)
class LossScore:
    """Every number that went into one peer's loss score."""

    loss_before_random: float
    loss_after_random: float
    loss_before_own: float
    loss_after_own: float
    n_random: int
    n_own: int
    norm: float
    target_norm: float
    norm_band: float
    own: OwnTest
    z_pass: float
    own_slots: tuple[int, ...] = ()

    @property
    def direction_score(self) -> float:
        """Relative improvement on random data at the common step (`s_dir`)."""
        return (self.loss_before_random - self.loss_after_random) / self.loss_before_random

    @property
    def norm_factor(self) -> float:
        """``q``: 1 inside the band around the median norm, lower outside it."""
        if self.target_norm <= 0 or not math.isfinite(self.norm):
            return 1.0
        r = self.norm / self.target_norm
        return min(1.0, self.norm_band * min(r, 1.0 / r)) if r > 0 else 0.0

    @property
    def score(self) -> float:
        """``s``: the direction score, lowered (never raised) by a norm outside the band."""
        s, q = self.direction_score, self.norm_factor
        return s * q if s >= 0 else s * (2.0 - q)

    @property
    def own_gain(self) -> float:
        return (self.loss_before_own - self.loss_after_own) / self.loss_before_own

    @property
    def indicator(self) -> int:
        return 1 if self.own.z >= self.z_pass else -1


# -- statistics ------------------------------------------------------------------------------------


def welch(own: np.ndarray, rand: np.ndarray) -> OwnTest:
    """Difference of means over its standard error (unequal variances)."""
    if own.size < 2 or rand.size < 2:
        return OwnTest(0.0, 0.0, 0.0, "welch")
    diff = float(own.mean() - rand.mean())
    se = math.sqrt(float(own.var(ddof=1)) / own.size + float(rand.var(ddof=1)) / rand.size)
    return OwnTest(diff / se if se > 0 else 0.0, diff, se, "welch")


def ancova(own: np.ndarray, rand: np.ndarray, c_own: np.ndarray, c_rand: np.ndarray) -> OwnTest:
    """The own-data effect ``b`` of ``g = a + b [own] + θ·c + ε`` (OLS), over its standard error;
    ``c`` one covariate per column (or a single one, 1-D). Each covariate enters standardised (``b``
    and its error do not depend on a covariate's scale) and only if it keeps the design well
    conditioned: one that is constant, not finite, or a copy of one before it is left out, and
    with none left the test is `welch`. A covariate of float rounding (a consensus step a crowd of
    tiny updates shrank) costs one degree of freedom and nothing else."""
    y = np.concatenate([own, rand])
    c = np.concatenate([c_own.reshape(own.size, -1), c_rand.reshape(rand.size, -1)])
    n = y.size
    x = np.column_stack([np.ones(n), np.r_[np.ones(own.size), np.zeros(rand.size)]])
    for col in c.T:
        spread = float(col.std()) if np.all(np.isfinite(col)) else 0.0
        if spread <= 1e-12 * (abs(float(col.mean())) + 1) or n < x.shape[1] + 3:
            continue
        trial = np.column_stack([x, (col - col.mean()) / spread])
        if np.linalg.cond(trial.T @ trial) <= 1e12:
            x = trial
    if x.shape[1] == 2:
        return welch(own, rand)
    inv = np.linalg.inv(x.T @ x)
    beta = inv @ (x.T @ y)
    res = y - x @ beta
    var_b = float(res @ res) / (n - x.shape[1]) * float(inv[1, 1])
    se = math.sqrt(var_b) if var_b > 0 else 0.0
    b = float(beta[1])
    return OwnTest(b / se if se > 0 else 0.0, b, se, "ancova")


def reference_norm(norms: Mapping[int, float]) -> float:
    """``T``: the (low) median of the finite, positive norms (0 when there are none). The low
    median keeps one outsized update out of ``T`` even among two."""
    ok = [n for n in norms.values() if math.isfinite(n) and n > 0]
    return float(statistics.median_low(ok)) if ok else 0.0


REUSE_SPREAD = 0.01
"""How far (relative) an update's norm may be from ``T`` for its probe at its own norm to stand
for its probe at ``T``: a step at most 1 % longer or shorter."""


# -- the probe -------------------------------------------------------------------------------------


def pick_scored(
    run_id: str, window: int, uids: Sequence[int], limit: int, first: Collection[int] = ()
) -> list[int]:
    """The peers scored this window, in the order they are scored: all of them (or the first
    `limit`), the uids in `first` before the others, each group in an order drawn by a hash of
    (run, window), so that when time runs out (`validator.loop`) no uid is always the one left
    unscored, and updates already refused (copies, replays: scored only for the report) never
    take the time of the accepted ones."""

    def draw(uid: int) -> tuple[bool, bytes]:
        digest = hashlib.blake2b(f"score/{run_id}/{window}/{uid}".encode(), digest_size=8)
        return uid not in first, digest.digest()

    ordered = sorted(uids, key=draw)
    return ordered if limit <= 0 else ordered[:limit]


def scored_after_agreement(
    draw: Sequence[int], applied: Collection[int], established: Collection[int], cap: int
) -> list[int]:
    """The updates scored after a window's agreement, in order: the `applied` ones, then the
    others, each part in the window's `draw` (`pick_scored`), at most `cap` of them (0: all).
    Of the applied ones, those of peers without earning evidence (not in `established`) come
    first: a loaded validator that scores few gives them the first rating their pay waits for,
    while an earning peer unscored keeps its standing (and is scored before any update the
    window refused). The count is the run's bound (`ValidatorConfig.scored_per_window`),
    whatever the number of registered hotkeys; the draw changes every window, so every peer is
    scored in turn."""
    chosen, known = set(applied), set(established)
    # stable: each part in draw order
    order = sorted(draw, key=lambda u: (u not in chosen, u in chosen and u in known))
    return order if cap <= 0 else order[:cap]


class LossProbe:
    """Scores updates of one window against the model at the start of that window.

    `norms` holds the norms of the window's accepted updates; `reference` the
    updates of the consensus direction ``ref = mean_j (T / n_j) Δ̂_j`` (the accepted updates of
    peers with established own-data evidence, `validator.ratings.Book.consensus`), whose
    per-sample gain ``r(x)`` is measured once on ``R`` and once per peer on ``O_i``. To first order in the (small) probe step
    the gain of a mean is the mean of the gains, so the leave-one-out covariate of a reference
    member ``i`` scored on its own reference update (the same object) is
    ``(N r(x) - k g_i(x)) / (N - 1)``, ``k`` its multiplier in the reference over its multiplier
    in the probe (1 at ``T``; at its own norm ``T / n_i``, which a crowd of tiny updates can make
    small: the covariate then carries no share of ``g_i`` to cancel); for anything else it is
    ``r(x)`` (an update that is in the consensus at weight 1/N only makes its own test more
    conservative).

    `previous` (while no two peers have earned, the run's first windows) is the previous
    window's outer step (weights before it less weights after): the gain of that step at
    ``score_scale`` of its length is a second covariate, for every update. Every validator holds
    it, and no update of this window, however many hotkeys sent them, has a share in it: a crowd
    that dilutes the consensus (tiny updates set its step's length, their norms' median, to
    theirs: its gain is float rounding) leaves this one whole.

    `start` is the window's start as taken before the gather (`validator.probe_start`): the
    passes it holds are not run again.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        run: RunConfig,
        dataset: Dataset,
        window: int,
        reveal: SampleReveal,
        reference: Mapping[int, Update],
        norms: Mapping[int, float],
        cfg: ValidatorConfig,
        device: torch.device,
        fmt: UpdateFormat | None = None,
        previous: Mapping[str, torch.Tensor] | None = None,
        start: ProbeStart | None = None,
    ) -> None:
        # the window's start (`validator.probe_start`), taken before the gather where given
        self.base = start or ProbeStart(model, run, dataset, window, reveal, cfg, device, fmt)
        self.base.use_previous(previous)
        self.model, self.run, self.cfg = model, run, cfg
        self.eta = cfg.score_scale * run.outer.alpha
        self.members = [
            u for u in sorted(reference) if u in norms and math.isfinite(norms[u]) and norms[u] > 0
        ]
        # the consensus direction's members at their lower median norm
        self.target = reference_norm({u: norms[u] for u in self.members})
        self.reference, self.norms = reference, norms
        self.ref = self._consensus(reference, norms)
        # the consensus step's per-sample gains on the random samples (None: no such step)
        self.ref_random = self.base.step_gain(self.ref, self.before_random, self.random)
        self._ref_own: dict[int, np.ndarray | None] = {}

    @property
    def stop(self) -> Callable[[], bool] | None:
        """Asked before each forward pass: True stops the probe (`OutOfTime`)."""
        return self.base.stop

    @stop.setter
    def stop(self, stop: Callable[[], bool] | None) -> None:
        self.base.stop = stop

    @property
    def random(self) -> torch.Tensor:
        return self.base.random

    @property
    def before_random(self) -> np.ndarray:
        return self.base.random_losses()

    @property
    def start(self) -> dict[str, torch.Tensor]:
        return self.base.start

    @property
    def prev(self) -> dict[str, torch.Tensor] | None:
        return self.base.prev

    def _factor(self, norm: float, target: float) -> float:
        """The step multiplier that brings an update of `norm` to ``η target``."""
        if target <= 0 or norm <= 0 or not math.isfinite(norm):
            return self.eta if norm > 0 and math.isfinite(norm) else 0.0
        return self.eta * target / norm

    def _consensus(
        self, reference: Mapping[int, Update], norms: Mapping[int, float]
    ) -> dict[str, torch.Tensor] | None:
        if not self.members:
            return None
        params = dict(self.model.named_parameters())
        keep, fmt = self.base.keep, self.base.format
        ref = {k: zeros_on(p, keep) for k, p in params.items()}
        for uid in self.members:  # one decoded update at a time (`Pieces`)
            f = self._factor(norms[uid], self.target) / len(self.members)
            for piece in reference[uid]:
                out, beside = ref[piece.name], params[piece.name]
                if out.device == beside.device:
                    fmt.add_into(out, piece, f)
                    continue
                # kept on the host: the piece's part built beside the model, then added there
                # (0 + x, then out + x: the same sum as adding into out directly)
                part = torch.zeros_like(beside)
                fmt.add_into(part, piece, f)
                out.add_(part.to(out.device))
        return ref

    def _covariate(
        self, uid: int, update: Update, g: np.ndarray, r: np.ndarray, factor: float
    ) -> np.ndarray | None:
        """The covariate of `uid`'s gains `g`, probed at step multiplier `factor`: ``r``, less
        the member's own share when it is in the reference (its gain at the reference's
        multiplier is ``g`` scaled by that over `factor`, to first order)."""
        n = len(self.members)
        if uid not in self.members or self.reference[uid] is not update:
            return r if n >= 1 else None
        if n < 2 or factor <= 0:
            return None
        share = self._factor(self.norms[uid], self.target) / factor
        return (n * r - share * g) / (n - 1)

    def _ref_gain_own(self, uid: int) -> np.ndarray | None:
        """`uid`'s own samples' gains under the consensus step: the same whatever update of
        `uid` is probed at whatever norm, so run once per peer (the lead probes an update at its
        own norm, then again at ``T``)."""
        if uid not in self._ref_own:
            _, samples, before = self.base.own(uid)
            self._ref_own[uid] = self.base.step_gain(self.ref, before, samples)
        return self._ref_own[uid]

    def score(self, uid: int, update: Update, norm: float, target: float) -> LossScore:
        """`uid`'s update (of `norm`) probed at the step of norm `target` (``T``; `norm` itself
        for the probe at its own norm)."""
        slots, own, before_own = self.base.own(uid)
        ref_own, prev_own = self._ref_gain_own(uid), self.base.prev_own(uid)
        factor = self._factor(norm, target)
        after_random, after_own = self.base.stepped(update, [self.random, own], factor)
        g_rand = self.base.gain(self.before_random, after_random)
        g_own = self.base.gain(before_own, after_own)
        covariates = []  # (on the own samples, on the random ones)
        if ref_own is not None and self.ref_random is not None:
            c_own = self._covariate(uid, update, g_own, ref_own, factor)
            c_rand = self._covariate(uid, update, g_rand, self.ref_random, factor)
            if c_own is not None and c_rand is not None:
                covariates.append((c_own, c_rand))
        prev_random = self.base.prev_random()
        if prev_own is not None and prev_random is not None:
            covariates.append((prev_own, prev_random))
        test = welch(g_own, g_rand)
        if covariates:
            own_c, rand_c = (np.column_stack(cs) for cs in zip(*covariates, strict=True))
            test = ancova(g_own, g_rand, own_c, rand_c)
        return LossScore(
            loss_before_random=float(self.before_random.mean()),
            loss_after_random=float(after_random.mean()),
            loss_before_own=float(before_own.mean()),
            loss_after_own=float(after_own.mean()),
            n_random=int(self.random.shape[0]),
            n_own=int(own.shape[0]),
            norm=float(norm),
            target_norm=target,
            norm_band=self.cfg.norm_band,
            own=test,
            z_pass=self.cfg.own_z_pass,
            own_slots=slots,
        )
