"""The fast filters: what is wrong with an upload, as a verdict plus a human-readable detail.

Verdicts, in the order they are decided:

* from the fetch (`node.window.exchange.fetch`, the rule every peer applies): ``missing`` (no object, no
  usable commitment), ``unreachable`` (the bucket failed or hung), ``late`` (object LastModified
  more than the run's ``clock_skew_tolerance_s`` after the deadline), ``invalid`` (bad signature,
  or a header naming another run id / window / uid / hotkey), ``malformed`` (`DecodeError`, over
  the size cap, anything else the decoder refused);
* from the decoded values: ``non_finite`` (the update's norm is not finite) and, once the window's
  applied set is known, ``norm_outlier`` (its L2 norm exceeds ``norm_ratio`` (default 10) times
  the lower median norm of the applied updates: an honest update's norm is set by the shared
  learning-rate schedule, so the honest population is tight — the measured max/median is below
  2 — while a 10x step would dominate the mean aggregate);
* from `validator.copies`: ``copy`` and ``replay``.

Sync is reported separately (it scales the score, it does not disqualify the update): the peer's
published fingerprint for w-1 against ours; a peer that published none is out of sync.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping
from enum import StrEnum

from node.window.gather import Fetched


class Verdict(StrEnum):
    OK = "ok"
    MISSING = "missing"
    UNREACHABLE = "unreachable"
    LATE = "late"
    INVALID = "invalid"
    MALFORMED = "malformed"
    NON_FINITE = "non_finite"
    NORM_OUTLIER = "norm_outlier"
    COPY = "copy"
    REPLAY = "replay"
    EQUIVOCATION = "equivocation"  # signed two different updates for one window


ABSENT = {Verdict.MISSING, Verdict.UNREACHABLE}
"""Verdicts under which the peer's bytes never reached us (nothing else can be checked)."""
DROPPED = {Verdict.MISSING, Verdict.UNREACHABLE, Verdict.LATE, Verdict.INVALID, Verdict.MALFORMED}
"""Verdicts under which every honest peer also drops the update from its aggregate."""


def classify_fetch(fetched: Fetched) -> tuple[Verdict, str]:
    """The verdict of `node.window.exchange.fetch`'s outcome (its reason strings are its contract)."""
    reason = fetched.reason
    if fetched.ok:
        return Verdict.OK, "ok"
    if reason == "missing" or reason.startswith("no commitment") or reason.startswith("bad commit"):
        return Verdict.MISSING, reason
    if reason.startswith("late"):
        return Verdict.LATE, reason
    if reason.startswith("unreachable"):
        return Verdict.UNREACHABLE, reason
    if reason.startswith("bad signature") or reason.startswith("malformed: update meta"):
        return Verdict.INVALID, reason
    return Verdict.MALFORMED, reason


def norm_outliers(
    norms: Mapping[int, float], applied: Collection[float], ratio: float
) -> dict[int, str]:
    """The uids of `norms` whose norm exceeds `ratio` times the lower median of the `applied`
    norms (the updates the window applies: half of them at the value cap cannot raise it above
    every honest norm, and a crowd of null or tiny updates never gets into that set,
    `validator.admission`), each with the detail."""
    finite = [n for n in applied if math.isfinite(n)]
    median = statistics.median_low(finite) if finite else math.nan
    if not median > 0:
        return {}
    return {
        uid: f"norm {n:.4g} > {ratio:g} x median {median:.4g}"
        for uid, n in norms.items()
        if math.isfinite(n) and n > ratio * median
    }


def in_sync(peer_fingerprint: str | None, ours: str | None) -> bool | None:
    """Whether the peer's published fingerprint for w-1 equals ours; a peer that published none
    counts as out of sync (False). None only when we have nothing to compare with (window 0)."""
    if ours is None:
        return None
    return peer_fingerprint == ours
