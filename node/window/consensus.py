"""The window's consensus: which updates window ``w`` applies, byte for byte, on every honest node.

The rule (reasoning and attacks in docs/consensus.md):

1. **Roster at a pinned block.** Membership, bucket commitments and validator weights are read
   from one chain snapshot at the window's first block (`roster_block`), final long before anyone
   gathers, so every node derives the same roster and the same selected set
   (`node.window.selection.select_peers`) whatever lands on chain around the deadline.
2. **Two validators decide the set.** The deciders are the roster's validator-permit holders
   that have a bucket, most stake first (ties: lower uid): the lead and one standby
   (`DECIDERS`). After its gather each publishes the window's aggregate object (the exact bytes
   of every update it applies) and then a signed manifest (`node.window.manifest`) listing
   ``(uid, hotkey, digest, size)`` of exactly the selected updates that passed all of its
   checks, plus its model fingerprint at the start of the window.
3. **Everyone applies the deciding manifest**: the lead's when it counts, else the standby's.
   A node accepts a manifest only if it verifies against its decider's hotkey and every entry
   is a selected uid with the roster's hotkey. Each entry's bytes are the node's own fetched
   copy when its digest matches, else the copy in the decider's aggregate object; every update
   is then verified and decoded strictly (`check_update`) and the window takes the one outer
   step (`node.strategy`). A decider can leave updates out (censor); it cannot put in anything
   a selected peer did not sign, nor move the model further than the outer step's bounds allow.
4. **Waiting for it, by the chain's clock.** A decider's manifest of window ``w`` counts only if
   its store dated it by the timestamp of the window's cutoff block (`manifest_cutoff_block`:
   the gather block plus ``fetch_budget_s + manifest_wait_s`` in blocks), within the clock-skew
   tolerance (`judge`). A decider begins its PUT only while the chain is more than
   `PUBLISH_MARGIN_S` before the cutoff and writes it once; every node (the deciders too) reads
   until it can judge what it finds or the chain has reached the settle block, and then once
   more (`wait_for_manifest`). A PUT completed late is dated late and counts for nobody, so every
   honest node applies the same thing whatever its load and whenever the PUT landed.
5. **Without a manifest** that counts (or with one that does not resolve), a node applies
   nothing for the window, as the deciders then do too: every honest node
   takes the same (empty) step and keeps its update's error feedback. Only a run without any
   validator falls back on each node's own verified copies. A node that did fork (its own start
   differs from the manifest's ``fingerprint_start``) resyncs from the validators' published history
   before applying the window (`node.window.history`), and retries at the next window if that
   fails.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Protocol

from codec.spec import ModelSpec
from node.strategy.format import Decoded
from node.window.buckets import PeerBucket, buckets_from
from node.window.exchange import check_update
from node.window.gather import Fetched
from node.window.manifest import (
    ManifestError,
    WindowManifest,
    bytes_digest,
    manifest_cap,
    read_manifest,
)
from node.window.selection import select_peers
from protocol.chain.base import Chain
from protocol.chain.models import Metagraph
from protocol.naming import applied_key
from protocol.runconfig import RunConfig
from protocol.stores import ObjectNotFound, StoreError
from protocol.windows import WindowSchedule

log = logging.getLogger(f"tessera.{__name__}")

MANIFEST_POLL_S = 0.5
MANIFEST_POLL_MAX_S = 5.0
"""How often a node looks for the lead's manifest: a quarter block, within these bounds (every
peer polls the lead's bucket: on 12 s blocks that is one GET every 3 s, not two a second)."""


def roster_block(run: RunConfig, window: int) -> int:
    """The block whose chain state defines window `window`'s roster: its first block."""
    return WindowSchedule.from_run(run).first_block(window)


DECIDERS = 2
"""Validators that publish a decision for every window, by rank: the lead and one standby whose
decision applies when the lead's does not count (docs/consensus.md, failover)."""


@dataclass(frozen=True)
class Roster:
    """One pinned chain snapshot of a window: members, readable buckets (and why some are not),
    the selected uids, and the validators that decide, by rank (the lead first; none when no
    validator has a bucket)."""

    window: int
    block: int
    metagraph: Metagraph
    buckets: dict[int, PeerBucket]
    problems: dict[int, str]
    selected: list[int]
    deciders: tuple[PeerBucket, ...]

    @property
    def lead(self) -> PeerBucket | None:
        return self.deciders[0] if self.deciders else None

    def decider(self, uid: int) -> PeerBucket | None:
        """The deciding validator with `uid`, if it is one."""
        return next((d for d in self.deciders if d.uid == uid), None)

    def hotkey(self, uid: int) -> str | None:
        n = self.metagraph.neuron(uid)
        return n.hotkey if n is not None else None


def window_roster(chain: Chain, run: RunConfig, window: int, local_root: Path | None) -> Roster:
    """The roster every peer and validator computes alike for `window` (one pinned snapshot)."""
    block = roster_block(run, window)
    snap = chain.snapshot(block)
    buckets, problems = buckets_from(snap.metagraph, snap.commitments, local_root)
    selected = select_peers(
        snap.metagraph,
        {b.hotkey for b in buckets.values()},
        snap.weights,
        run,
        window,
    )
    deciders = rank_deciders(snap.metagraph, buckets)
    return Roster(window, block, snap.metagraph, buckets, problems, selected, deciders)


def rank_deciders(
    metagraph: Metagraph, buckets: Mapping[int, PeerBucket]
) -> tuple[PeerBucket, ...]:
    """The validator-permit holders with a bucket, most stake first (ties: lower uid), at most
    `DECIDERS` of them."""
    ranked = sorted(
        (n for n in metagraph.validators if n.uid in buckets), key=lambda n: (-n.stake, n.uid)
    )
    return tuple(buckets[n.uid] for n in ranked[:DECIDERS])


PUBLISH_MARGIN_S = 2.0
"""How long (at least one block) before the cutoff block the lead stops starting a manifest PUT."""

MIN_PUBLISH_RESERVE_S = 2.0
"""The least time the lead keeps to publish after its probes (`validator.admission`): the
decision's few requests (the aggregate, the manifest, a read of the chain's block). A probe
still running when that time begins is stopped before its next forward pass
(`validator.window_scores.WindowScorer.own_norm_score`)."""

MANIFEST_SETTLE_S = 2.0
"""How long after the latest store time that counts a node waits before its last read: a
manifest its store dated on time is visible by then (an HTTP date is cut to the whole second, and
a store completes a PUT of a kilobyte well within another; docs/consensus.md)."""

READ_RETRY_S = 30.0
"""How long past the settle block a node keeps retrying a manifest read that failed (not a 404)."""


class ChainTime(Protocol):
    """The chain's clock as the manifest rule reads it (`protocol.chain.base.Chain` is one)."""

    def block(self) -> int: ...

    def block_timestamp(self, block: int) -> datetime: ...


@dataclass(frozen=True)
class StoredManifest:
    """The lead's verified manifest and the time its store gives for it (``Last-Modified``)."""

    manifest: WindowManifest
    stored_at: datetime


def manifest_cutoff_block(run: RunConfig, window: int) -> int:
    """The block by whose timestamp the lead's manifest of `window` must be stored to count: the
    gather block plus ``fetch_budget_s + manifest_wait_s`` worth of blocks."""
    wait_s = run.consensus.fetch_budget_s + run.consensus.manifest_wait_s
    schedule = WindowSchedule.from_run(run)
    return schedule.gather_block(window) + math.ceil(wait_s / run.timing.block_time_s)


def settle_block(run: RunConfig, window: int) -> int:
    """The block from which a node's read of `window`'s manifest is its last: the clock-skew
    tolerance and `MANIFEST_SETTLE_S` (at least one block) after the cutoff block."""
    settle_s = run.timing.clock_skew_tolerance_s + MANIFEST_SETTLE_S
    return manifest_cutoff_block(run, window) + max(
        1, math.ceil(settle_s / run.timing.block_time_s)
    )


def last_publish_block(run: RunConfig, window: int) -> int:
    """The block from which the lead no longer starts `window`'s manifest PUT: `PUBLISH_MARGIN_S`
    (and at least one block) before the cutoff block."""
    margin = max(1, math.ceil(PUBLISH_MARGIN_S / run.timing.block_time_s))
    return manifest_cutoff_block(run, window) - margin


def may_publish(run: RunConfig, window: int, block: int) -> bool:
    """Whether the lead, at chain block `block`, may still publish `window`'s manifest."""
    return block < last_publish_block(run, window)


def stored_on_time(stored_at: datetime, bound: datetime, run: RunConfig) -> bool:
    """Whether a manifest stored at `stored_at` (its store's time) counts against `bound` (a
    block's chain timestamp), within the run's clock-skew tolerance."""
    late_by = (stored_at - bound).total_seconds()
    return late_by <= run.timing.clock_skew_tolerance_s


def judge(
    stored: StoredManifest, head: int, run: RunConfig, window: int, chain: ChainTime
) -> bool | None:
    """Whether `stored`, read with the chain at block `head`, counts: once the chain has reached
    the cutoff block, by that block's timestamp; before it, True if it is on time even against
    the head's (block timestamps never go back), else None (not known yet)."""
    cutoff = manifest_cutoff_block(run, window)
    if head >= cutoff:
        return stored_on_time(stored.stored_at, chain.block_timestamp(cutoff), run)
    if stored_on_time(stored.stored_at, chain.block_timestamp(head), run):
        return True
    return None


def wait_for_manifest(
    roster: Roster, run: RunConfig, window: int, chain: ChainTime
) -> WindowManifest | None:
    """The manifest that decides `window`: the highest-ranked decider's (`Roster.deciders`) whose
    store dated it by the cutoff block's timestamp; None if no decider has one that counts (none
    stored, stored later, or invalid: logged, and every honest node finds it so alike). A node
    reads until the lead's manifest is judged (`judge`: it counts, or it is late and a standby's
    is judged) or the chain has reached the settle block, and then once more: every manifest
    stored on time is visible to that last read, whatever the node's load. A read that fails
    (not a 404) is retried for up to `READ_RETRY_S` past the settle block."""
    if not roster.deciders:  # a run without validators: nobody publishes one
        return None
    last = settle_block(run, window)
    begun = time.monotonic()
    log.info(
        "window %d: waiting for the lead's manifest stored by block %d",
        window,
        manifest_cutoff_block(run, window),
    )
    give_up: float | None = None
    while True:
        head = chain.block()
        final = head >= last  # before the read: a read begun after the settle block is final
        if final and give_up is None:
            give_up = time.monotonic() + READ_RETRY_S
        try:
            verdicts = _verdicts(roster, run, window, chain, head, final)
        except StoreError as exc:
            log.warning("window %d: a deciding validator's manifest is unreadable: %s", window, exc)
            if give_up is not None and time.monotonic() > give_up:
                return None
        else:
            decided = _decision(verdicts, final)
            if decided is not None:
                took = time.monotonic() - begun
                manifest = decided[0]
                found = _describe(verdicts, manifest)
                log.info("window %d: %s after %.1f s", window, found, took)
                return manifest
        time.sleep(min(MANIFEST_POLL_MAX_S, max(MANIFEST_POLL_S, run.timing.block_time_s / 4)))


Verdict = tuple[StoredManifest | None, bool | None]
"""One decider's manifest as last read, and whether it counts (None: not known yet)."""


def _verdicts(
    roster: Roster, run: RunConfig, window: int, chain: ChainTime, head: int, final: bool
) -> list[Verdict]:
    """Each decider's manifest, by rank, read until one counts (the ones after it do not
    matter); `StoreError` if a read that matters failed."""
    out: list[Verdict] = []
    for decider in roster.deciders:
        stored = published_manifest(run, window, decider)
        counts = judge(stored, head, run, window, chain) if stored is not None else None
        out.append((stored, counts))
        if counts or (counts is None and not final):
            break  # it decides, or the ones after it do not matter yet
    return out


def _decision(verdicts: list[Verdict], final: bool) -> tuple[WindowManifest | None] | None:
    """The deciding manifest, in a 1-tuple (holding None when no decider's counts), once every
    higher-ranked decider's is known not to count; None while that is not known yet."""
    for stored, counts in verdicts:
        if counts is None:
            if not final:
                return None
            counts = False  # read after the settle block: a manifest not judged on time is late
        if counts and stored is not None:
            return (stored.manifest,)
    return (None,)


def _describe(verdicts: list[Verdict], manifest: WindowManifest | None) -> str:
    if manifest is None:
        stored = [v[0] for v in verdicts if v[0] is not None]
        if stored:
            return f"no manifest counts (stored after the cutoff: {stored[0].stored_at})"
        return "no manifest by the cutoff"
    rank = "the lead's" if verdicts[0][1] else "the standby's (the lead's does not count)"
    return f"manifest of validator uid {manifest.validator_uid} found, {rank}"


def published_manifest(run: RunConfig, window: int, lead: PeerBucket) -> StoredManifest | None:
    """One read of deciding validator `lead`'s manifest of `window` and its store time: None when
    there is no manifest or an invalid one (logged); `StoreError` when the read itself failed."""
    cap = manifest_cap(run.gather_size)
    key = applied_key(run.run_id, window, lead.uid, lead.hotkey)
    try:
        info = lead.store.head(key)
        manifest = read_manifest(lead.store, run.run_id, window, lead.uid, lead.hotkey, cap)
    except ObjectNotFound:
        return None
    except ManifestError as exc:
        log.warning("window %d: manifest of validator uid %d invalid: %s", window, lead.uid, exc)
        return None
    return StoredManifest(manifest, info.last_modified)


def check_manifest(manifest: WindowManifest, roster: Roster) -> None:
    """`ManifestError` unless every entry is a selected uid under the roster's hotkey."""
    selected = set(roster.selected)
    for e in manifest.entries:
        if e.uid not in selected:
            raise ManifestError(f"manifest applies uid {e.uid}, which the roster did not select")
        if roster.hotkey(e.uid) != e.hotkey:
            raise ManifestError(f"manifest names hotkey {e.hotkey} for uid {e.uid}")
    if manifest.roster_block != roster.block:
        raise ManifestError(f"manifest roster block {manifest.roster_block} != {roster.block}")


def resolve(
    manifest: WindowManifest,
    roster: Roster,
    fetched: Mapping[int, Fetched],
    lead_copies: Callable[[], Mapping[int, bytes]],
    run: RunConfig,
    spec: ModelSpec,
) -> dict[int, Decoded]:
    """Every manifest entry's verified update: our own copy when its digest matches, else the
    lead's copy (`lead_copies` is called at most once). `ManifestError` if any entry cannot be
    resolved to bytes with its digest that verify and decode."""
    check_manifest(manifest, roster)
    out: dict[int, Decoded] = {}
    theirs: Mapping[int, bytes] | None = None
    for e in manifest.entries:
        own = fetched.get(e.uid)
        if own is not None and own.update is not None and own.digest == e.digest:
            out[e.uid] = own.update
            continue
        if theirs is None:
            theirs = lead_copies()
        data = theirs.get(e.uid)
        if data is None or len(data) != e.size or bytes_digest(data) != e.digest:
            raise ManifestError(f"no copy of uid {e.uid}'s update with the manifest's digest")
        try:
            out[e.uid] = check_update(data, e.uid, e.hotkey, run, spec, manifest.window)
        except ValueError as exc:  # DecodeError / SignatureError
            raise ManifestError(f"uid {e.uid}'s pinned update does not verify: {exc}") from None
    return out


def local_choice(roster: Roster, fetched: Mapping[int, Fetched]) -> dict[int, Decoded]:
    """A run without validators: our own verified copies of the selected updates."""
    return {
        uid: fetched[uid].update  # type: ignore[misc]
        for uid in roster.selected
        if uid in fetched and fetched[uid].update is not None
    }


@dataclass(frozen=True)
class Agreement:
    """What a node applies for a window, and how it got there."""

    updates: dict[int, Decoded]
    manifest: WindowManifest | None
    forked: bool  # our model at the start of the window differs from the lead validator's
    note: str  # "manifest of validator uid N" | why nothing (or our own choice) was applied
    lead_fingerprint: str | None = None  # the lead's model at the start of the window, if known


def agree(
    roster: Roster,
    fetched: Mapping[int, Fetched],
    manifest: WindowManifest | None,
    start_fingerprint: str,
    run: RunConfig,
    spec: ModelSpec,
) -> Agreement:
    """The updates to apply: the manifest's, resolved to verified bytes; nothing without a
    usable manifest (what every honest node does alike); our own choice only in a run without
    a validator."""
    if roster.lead is None:
        return Agreement(local_choice(roster, fetched), None, False, "no validator: own choice")
    if manifest is None:
        cutoff = manifest_cutoff_block(run, roster.window)
        return Agreement({}, None, False, f"no manifest by block {cutoff}: nothing applied")
    lead_fp = manifest.fingerprint_start
    forked = lead_fp != start_fingerprint
    try:
        updates = resolve(
            manifest,
            roster,
            fetched,
            lambda: lead_copies(roster, run, spec, manifest.window, manifest.validator_uid),
            run,
            spec,
        )
    except ManifestError as exc:
        log.warning("window %d: manifest unusable (%s): nothing applied", manifest.window, exc)
        return Agreement({}, None, forked, f"manifest unusable: {exc}", lead_fp)
    note = f"manifest of validator uid {manifest.validator_uid}"
    return Agreement(updates, manifest, forked, note, lead_fp)


def lead_copies(
    roster: Roster, run: RunConfig, spec: ModelSpec, window: int, uid: int
) -> dict[int, bytes]:
    """The exact update bytes the deciding validator `uid` published for `window` ({} when
    unreadable, or when `uid` does not decide the window)."""
    from node.window.history import HistoryError, read_aggregate_bytes

    lead = roster.decider(uid)
    if lead is None:
        return {}
    try:
        return read_aggregate_bytes(lead.store, run, spec, window, lead.uid, lead.hotkey)
    except (HistoryError, StoreError) as exc:  # malformed, missing (404) or unreachable
        log.warning("window %d: aggregate of validator uid %d unusable: %s", window, lead.uid, exc)
        return {}
