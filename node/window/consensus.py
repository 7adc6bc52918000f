"""The window's consensus: which updates window ``w`` applies, byte for byte, on every honest node.

The rule (reasoning and attacks in docs/consensus.md):

1. **Roster at a pinned block.** Membership, bucket commitments and validator weights are read
   from one chain snapshot at the window's first block (`roster_block`), final long before anyone
   gathers, so every node derives the same roster and the same selected set
   (`node.window.selection.select_peers`) whatever lands on chain around the deadline.
2. **The lead validator decides the set.** The lead is the roster's validator-permit holder with
   the most stake (ties: lower uid) that has a bucket. After its gather it publishes the window's
   aggregate object (the exact bytes of every update it applies) and then a signed manifest
   (`node.window.manifest`) listing ``(uid, hotkey, digest, size)`` of exactly the selected
   updates that passed all of its checks, plus its model fingerprint at the start of the window.
3. **Everyone applies the manifest.** A node accepts a manifest only if it verifies against the
   lead's hotkey and every entry is a selected uid with the roster's hotkey. Each entry's bytes
   are the node's own fetched copy when its digest matches, else the copy in the lead's aggregate
   object; every update is then verified and decoded strictly (`check_update`) and the window
   takes the one outer step (`node.strategy`). The lead can leave updates out (censor);
   it cannot put in anything a selected peer did not sign, nor move the model further than the
   outer step's bounds allow.
4. **Waiting for it.** A node waits for the manifest at least ``fetch_budget_s + manifest_wait_s``
   after its gather began and then, while it can afford to, up to the moment its own next update
   would miss its deadline (`manifest_deadline`): a lead slowed down by load still reaches every
   honest node, instead of each falling back alone on what it happened to fetch.
5. **Without a manifest** by then, a node applies its own verified copies of the selected updates under the same bounds and carries on;
   the next manifest's ``fingerprint_start`` tells it whether it forked, and it then resyncs from
   the lead's published history before applying that window (`node.window.history`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from codec.spec import ModelSpec
from node.strategy.base import Decoded
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
from protocol.runconfig import RunConfig
from protocol.stores import ObjectNotFound, StoreError
from protocol.windows import WindowSchedule

log = logging.getLogger(f"tessera.{__name__}")

MANIFEST_POLL_S = 0.5


def roster_block(run: RunConfig, window: int) -> int:
    """The block whose chain state defines window `window`'s roster: its first block."""
    return WindowSchedule.from_run(run).first_block(window)


@dataclass(frozen=True)
class Roster:
    """One pinned chain snapshot of a window: members, readable buckets (and why some are not),
    the selected uids, and the lead validator (None when no validator has a bucket)."""

    block: int
    metagraph: Metagraph
    buckets: dict[int, PeerBucket]
    problems: dict[int, str]
    selected: list[int]
    lead: PeerBucket | None

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
    return Roster(
        block, snap.metagraph, buckets, problems, selected, _lead(snap.metagraph, buckets)
    )


def _lead(metagraph: Metagraph, buckets: Mapping[int, PeerBucket]) -> PeerBucket | None:
    ranked = sorted(
        (n for n in metagraph.validators if n.uid in buckets), key=lambda n: (-n.stake, n.uid)
    )
    return buckets[ranked[0].uid] if ranked else None


def manifest_deadline(begun: float, run: RunConfig, afford_until: float | None) -> float:
    """When a node stops waiting for the lead's manifest (monotonic seconds): at least
    ``fetch_budget_s + manifest_wait_s`` after its gather `begun`, and up to `afford_until` (the
    latest moment the node's own next deadline allows, None when it does not know) beyond."""
    floor = begun + run.consensus.fetch_budget_s + run.consensus.manifest_wait_s
    return floor if afford_until is None else max(floor, afford_until)


def wait_for_manifest(
    roster: Roster, run: RunConfig, window: int, until_monotonic: float
) -> WindowManifest | None:
    """The lead's verified manifest of `window`, polling until `until_monotonic`; None if none
    arrived (or the one published is invalid: that is logged, and we act as if there were none)."""
    lead = roster.lead
    if lead is None:
        return None
    cap = manifest_cap(run.gather_size)
    while True:
        try:
            return read_manifest(lead.store, run.run_id, window, lead.uid, lead.hotkey, cap)
        except ObjectNotFound:
            pass
        except (ManifestError, StoreError) as exc:
            log.warning(
                "window %d: manifest of validator uid %d unusable: %s", window, lead.uid, exc
            )
            if isinstance(exc, ManifestError):
                return None
        if time.monotonic() + MANIFEST_POLL_S > until_monotonic:
            return None
        time.sleep(MANIFEST_POLL_S)


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
    """The fallback without a manifest: our own verified copies of the selected updates."""
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
    note: str  # "manifest of validator uid N" | why we fell back to our own choice


def agree(
    roster: Roster,
    fetched: Mapping[int, Fetched],
    manifest: WindowManifest | None,
    start_fingerprint: str,
    run: RunConfig,
    spec: ModelSpec,
) -> Agreement:
    """The updates to apply: the manifest's, resolved to verified bytes; or, without a usable
    manifest, our own choice (`local_choice`)."""
    if manifest is None:
        return Agreement(local_choice(roster, fetched), None, False, "no manifest: own choice")
    forked = manifest.fingerprint_start != start_fingerprint
    try:
        updates = resolve(
            manifest,
            roster,
            fetched,
            lambda: lead_copies(roster, run, spec, manifest.window),
            run,
            spec,
        )
    except ManifestError as exc:
        log.warning("window %d: manifest unusable (%s): own choice", manifest.window, exc)
        return Agreement(local_choice(roster, fetched), None, forked, f"manifest unusable: {exc}")
    return Agreement(
        updates, manifest, forked, f"manifest of validator uid {manifest.validator_uid}"
    )


def lead_copies(roster: Roster, run: RunConfig, spec: ModelSpec, window: int) -> dict[int, bytes]:
    """The exact update bytes the lead validator published for `window` ({} when unreadable)."""
    from node.window.history import HistoryError, read_aggregate_bytes

    lead = roster.lead
    if lead is None:
        return {}
    try:
        return read_aggregate_bytes(lead.store, run, spec, window, lead.uid, lead.hotkey)
    except (HistoryError, StoreError) as exc:  # malformed, missing (404) or unreachable
        log.warning("window %d: aggregate of validator uid %d unusable: %s", window, lead.uid, exc)
        return {}
