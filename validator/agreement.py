"""The validator's part in a window's consensus (`node.window.consensus`).

The **lead** validator decides: the window applies exactly the selected uids whose updates passed
every check (fetch, decode, signature, norm, copy, replay). It publishes the exact bytes of those
updates (the aggregate object, which is also the run's history) and then the signed manifest
pinning each by digest, so that peers holding other bytes can take the validator's copy.

Any other validator **follows** the lead's manifest like a peer does, so all validators keep the
same model; without a usable manifest it falls back to its own decision, exactly as a peer would.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path

from substrateinterface import Keypair

from codec.spec import ModelSpec
from node.window.consensus import Agreement, Roster, agree, wait_for_manifest
from node.window.history import publish_aggregate
from node.window.manifest import Entry, WindowManifest, publish_manifest
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore, StoreError
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.fetching import Upload

log = logging.getLogger(f"tessera.{__name__}")


def lead_manifest(
    run: RunConfig,
    window: int,
    roster: Roster,
    checks: Mapping[int, PeerCheck],
    uid: int,
    hotkey: str,
    fingerprint_start: str,
) -> WindowManifest:
    """What the lead applies: every selected uid whose update passed all checks."""
    entries, rejected = [], {}
    for u in roster.selected:
        c = checks.get(u)
        if c is None or not c.ok or c.upload is None or c.upload.body is None:
            rejected[str(u)] = (c.verdict.value if c is not None else "missing")[:200]
            continue
        body = c.upload.body
        entries.append(Entry(uid=u, hotkey=c.hotkey, digest=body.digest, size=body.size))
    return WindowManifest(
        run_id=run.run_id,
        window=window,
        roster_block=roster.block,
        validator_uid=uid,
        validator_hotkey=hotkey,
        fingerprint_start=fingerprint_start,
        entries=tuple(entries),
        rejected=rejected,
    )


def publish_decision(
    store: ObjectStore,
    run: RunConfig,
    keypair: Keypair,
    manifest: WindowManifest,
    uploads: Mapping[int, Upload],
    scratch: Path,
) -> None:
    """The aggregate object first (peers fall back on its copies), then the manifest; the
    aggregate is written in `scratch`, one update read back from the spool at a time."""
    applied = {u: uploads[u].body for u in manifest.uids}
    try:
        publish_aggregate(
            store,
            run,
            manifest.window,
            manifest.validator_uid,
            keypair,
            applied,  # type: ignore[arg-type]
            scratch,
        )
        publish_manifest(store, manifest, keypair)
    except StoreError as exc:  # peers fall back to their own choice and resync next window
        log.error("window %d: publishing the manifest failed: %s", manifest.window, exc)


def lead_decision(
    store: ObjectStore,
    run: RunConfig,
    spec: ModelSpec,
    keypair: Keypair,
    window: int,
    roster: Roster,
    checks: Mapping[int, PeerCheck],
    uploads: Mapping[int, Upload],
    fingerprint_start: str,
    scratch: Path,
) -> Agreement:
    """The lead's agreement for `window` (`roster.lead` is us): the manifest it already published
    for that window, if any (a lead restarted between publishing and saving its state must never
    publish a second decision: peers may have applied the first), followed like any manifest;
    else a new decision, published (`publish_decision`) and applied."""
    if roster.lead is None or roster.lead.hotkey != keypair.ss58_address:
        raise ValueError("lead_decision is the lead's: the roster names another lead")
    published = wait_for_manifest(roster, run, window, time.monotonic())  # one look, no wait
    if published is not None:
        log.warning("window %d: adopting the manifest we published before a restart", window)
        return follow(roster, uploads, published, fingerprint_start, run, spec)
    manifest = lead_manifest(
        run, window, roster, checks, roster.lead.uid, keypair.ss58_address, fingerprint_start
    )
    publish_decision(store, run, keypair, manifest, uploads, scratch)
    return lead_agreement(manifest, uploads)


def lead_agreement(manifest: WindowManifest, uploads: Mapping[int, Upload]) -> Agreement:
    updates = {u: uploads[u].fetched.update for u in manifest.uids}
    return Agreement(updates, manifest, False, "own manifest (lead)")  # type: ignore[arg-type]


def mark_equivocations(checks: Mapping[int, PeerCheck], agreed: Agreement) -> list[int]:
    """Set ``equivocation`` on every peer whose update we verified under its signature while the
    lead's manifest pins other bytes, which the manifest's rules also verified under that
    signature: the peer signed two different updates for one window and served them to different
    readers. Our copy is not what the window applied, so it is neither scored nor paid. Returns
    the uids marked."""
    if agreed.manifest is None:
        return []
    marked = []
    for e in agreed.manifest.entries:
        c = checks.get(e.uid)
        body = c.upload.body if c is not None and c.upload is not None else None
        if c is None or body is None or body.digest == e.digest or e.uid not in agreed.updates:
            continue
        c.verdict = Verdict.EQUIVOCATION
        c.detail = (
            f"signed two updates for window {agreed.manifest.window}: "
            f"ours {body.digest[:12]}, the manifest's {e.digest[:12]}"
        )
        marked.append(e.uid)
    return marked


def follow(
    roster: Roster,
    uploads: Mapping[int, Upload],
    manifest: WindowManifest | None,
    fingerprint_start: str,
    run: RunConfig,
    spec: ModelSpec,
) -> Agreement:
    """A non-lead validator applies the lead's manifest, exactly as a peer does."""
    fetched = {u: up.fetched for u, up in uploads.items()}
    return agree(roster, fetched, manifest, fingerprint_start, run, spec)
