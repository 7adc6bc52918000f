"""Step 2 of the window: every peer's verdict, from the fetch to copies and replays.

Order: the fetch verdict (`checks.classify_fetch`); for the decoded updates a non-finite norm;
then, among the updates still OK, the
ones that other updates of the window, earlier updates or earlier aggregates explain (`copies`:
``copy`` and ``replay``). Norm outliers are judged once the window's applied set is known
(`mark_norm_outliers`). Sync is recorded for everyone
who published a fingerprint. A crash while checking one peer marks that peer ``malformed`` and
never stops the others.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from codec.aggregate import clip_factors
from codec.spec import ModelSpec
from node.strategy import make_format
from node.strategy.format import Decoded, UpdateFormat
from protocol.runconfig import RunConfig
from protocol.stores.spool import SpoolError
from validator.checks import Verdict, classify_fetch, in_sync, norm_outliers
from validator.config import ValidatorConfig
from validator.copies import (
    Explained,
    Match,
    Sketch,
    SketchHistory,
    Stamp,
    aggregate_sketch,
    best_matches,
    explain_window,
    sketch,
)
from validator.fetching import Upload

log = logging.getLogger(f"tessera.{__name__}")


@dataclass
class PeerCheck:
    """Everything the checks found out about one peer in one window."""

    uid: int
    hotkey: str
    upload: Upload | None  # None: no usable commitment
    verdict: Verdict
    detail: str
    norm: float | None = None
    in_sync: bool | None = None
    sketch: Sketch | None = None
    closest: Match | None = None
    explained: Explained | None = None

    @property
    def ok(self) -> bool:
        return self.verdict is Verdict.OK


@dataclass(frozen=True)
class Measured:
    """What the checks take of one decoded update: its norm and sketch, or why they failed."""

    norm: float | None = None
    sketch: Sketch | None = None
    error: str | None = None


def measure(
    uid: int,
    update: Decoded,
    window: int,
    spec: ModelSpec,
    run: RunConfig,
    cfg: ValidatorConfig,
    salt: int,
    fmt: UpdateFormat,
) -> Measured:
    """The norm (`UpdateFormat.norm`) and the copy sketch (`validator.copies.sketch`) of `update`,
    decoded once; a peer's update that breaks them is its failure, our spool's is ours."""
    try:
        tensors = update.tensors
        return Measured(
            fmt.norm(tensors),
            sketch(
                uid, window, update.digest, tensors,
                spec, run.codec, cfg.sketch_size, salt, fmt.entries,
            ),
        )  # fmt: skip
    except SpoolError:
        raise  # our disk, not the peer's update
    except Exception as exc:  # one bad peer never stops the window
        log.exception("window %d: checking uid %d failed", window, uid)
        return Measured(error=str(exc))


def check_window(
    window: int,
    hotkeys: Mapping[int, str],
    uploads: Mapping[int, Upload],
    no_bucket: Mapping[int, str],
    our_previous_fingerprint: str | None,
    history: SketchHistory,
    run: RunConfig,
    spec: ModelSpec,
    cfg: ValidatorConfig,
    salt: int,
    fmt: UpdateFormat | None = None,
) -> dict[int, PeerCheck]:
    """Every registered peer's `PeerCheck` (keyed by uid); ``fmt``: the validator's own strategy's
    format (norms, supports and entries of the run's update kind, at this window's state)."""
    out: dict[int, PeerCheck] = {}
    fmt = fmt or make_format(run, spec)
    for uid, hotkey in sorted(hotkeys.items()):
        up = uploads.get(uid)
        if up is None:
            out[uid] = PeerCheck(uid, hotkey, None, Verdict.MISSING, no_bucket.get(uid, "missing"))
            continue
        verdict, detail = classify_fetch(up.fetched)
        out[uid] = PeerCheck(uid, hotkey, up, verdict, detail)
        out[uid].in_sync = in_sync(up.fingerprint, our_previous_fingerprint)
        if up.fetched.update is None:
            continue
        m = up.measured or measure(
            uid, up.fetched.update, window, spec, run, cfg, salt, fmt
        )  # measured at the fetch, or decoded again from its body here
        if m.error is not None:
            out[uid].verdict, out[uid].detail = Verdict.MALFORMED, f"check failed: {m.error}"
        out[uid].norm, out[uid].sketch = m.norm, m.sketch
    for c in out.values():
        if c.ok and c.norm is not None and not math.isfinite(c.norm):
            c.verdict, c.detail = Verdict.NON_FINITE, f"norm {c.norm}"
    _copies_and_replays(out, history, cfg)
    return out


def mark_norm_outliers(
    checks: Mapping[int, PeerCheck], applied: Collection[int], ratio: float
) -> list[int]:
    """Judge the accepted updates' norms against the window's `applied` set
    (`validator.checks.norm_outliers`); the uids now ``norm_outlier``."""
    accepted = {u: c.norm for u, c in checks.items() if c.ok and c.norm is not None}
    reference = [accepted[u] for u in applied if u in accepted]
    marked = norm_outliers(accepted, reference, ratio)
    for uid, detail in marked.items():
        checks[uid].verdict, checks[uid].detail = Verdict.NORM_OUTLIER, detail
    return sorted(marked)


def _copies_and_replays(
    checks: dict[int, PeerCheck], history: SketchHistory, cfg: ValidatorConfig
) -> None:
    """`validator.copies.explain_window` over the updates still OK: ``copy`` when this window's
    earlier uploads explain the update, else ``replay`` when one earlier object does."""
    sketches = {u: c.sketch for u, c in checks.items() if c.ok and c.sketch is not None}
    for uid, match in best_matches(sketches).items():
        checks[uid].closest = match
    stamps = {
        u: Stamp(checks[u].upload.last_modified, checks[u].upload.keeps_clock)  # type: ignore[union-attr]
        for u in sketches
    }
    for uid, e in explain_window(sketches, stamps, history, cfg.replay_threshold).items():
        c = checks[uid]
        c.explained = e
        if e.window.share >= cfg.copy_threshold:
            c.verdict, c.detail = Verdict.COPY, e.window.detail()
        elif e.history.share >= cfg.replay_threshold:
            c.verdict, c.detail = Verdict.REPLAY, e.history.detail()


def applied_sketch(
    window: int, applied: Mapping[int, Decoded], checks: Mapping[int, PeerCheck], spec: ModelSpec,
    run: RunConfig, cfg: ValidatorConfig, salt: int, fmt: UpdateFormat,
) -> Sketch:  # fmt: skip
    """The sketch of the mean a window applies (what a recycler would re-upload), with each
    update scaled by its whole-update clip factor: the mean clips sparse updates chunk by chunk,
    which rescales chunks by a few per cent and leaves positions and signs, all a recycler's copy
    is matched on (the sketches keep no per-chunk norms)."""
    uids = sorted(applied)
    members, norms = [], []
    for u in uids:
        up, check = applied[u], checks.get(u)
        if check and check.sketch and check.norm is not None and check.sketch.digest == up.digest:
            members.append(check.sketch)  # our own copy: already measured
            norms.append(check.norm)
            continue
        tensors = up.tensors  # the lead's copy: measured here, once
        members.append(
            sketch(
                u, window, up.digest, tensors, spec, run.codec, cfg.sketch_size, salt, fmt.entries
            )
        )
        norms.append(fmt.norm(tensors))
    factors = clip_factors(norms)
    return aggregate_sketch(window, members, [f / len(uids) for f in factors])
