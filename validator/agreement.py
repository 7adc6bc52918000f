"""The validator's part in a window's consensus (`node.window.consensus`).

The two **deciding** validators (the lead, and the standby next to it by stake) each decide: the
window applies exactly the selected uids whose updates passed every check (fetch, decode,
signature, copy, replay) and showed training on the peer's own samples (`validator.admission`).
Each publishes the exact bytes of those updates (the aggregate object, which is also the run's
history) and then the signed manifest pinning each by digest, so that peers holding other bytes
can take the decider's copy (`propose`).

A manifest counts only if its store dated it by the window's cutoff block's timestamp
(`node.window.consensus.wait_for_manifest`); the lead's applies when it counts, else the
standby's. A decider reads the manifests back like every node and applies the one that counts,
or nothing (`adopt`); when that is not its own decision, it publishes what it applied as its
history instead, so every validator's history replays what the window applied.

Any other validator **follows** the deciding manifest like a peer does, so all validators keep
the same model.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from substrateinterface import Keypair

from codec.spec import ModelSpec
from node.window.buckets import PeerBucket
from node.window.consensus import (
    Agreement,
    ChainTime,
    Roster,
    agree,
    manifest_cutoff_block,
    may_publish,
    published_manifest,
    wait_for_manifest,
)
from node.window.history import publish_aggregate
from node.window.manifest import Entry, WindowManifest, publish_manifest
from protocol.runconfig import RunConfig
from protocol.stores import ObjectExists, ObjectStore, StoreError
from validator.admission import Admission
from validator.checks import Verdict
from validator.classify import PeerCheck
from validator.fetching import Upload

log = logging.getLogger(f"tessera.{__name__}")


def lead_manifest(
    run: RunConfig,
    window: int,
    roster: Roster,
    checks: Mapping[int, PeerCheck],
    admission: Admission,
    uid: int,
    hotkey: str,
    fingerprint_start: str,
) -> WindowManifest:
    """What the lead applies: every selected uid whose update passed all checks and showed
    training (`validator.admission`)."""
    entries, rejected = [], {}
    for u in roster.selected:
        c = checks.get(u)
        if c is None or not c.ok or c.upload is None or c.upload.body is None:
            rejected[str(u)] = (c.verdict.value if c is not None else "missing")[:200]
            continue
        if u not in admission.admitted:
            rejected[str(u)] = admission.refused.get(u, "not admitted")[:200]
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
    block_now: Callable[[], int],
) -> None:
    """The aggregate object first (peers fall back on its copies), then the manifest, if the
    chain is still before the last block to publish once the aggregate is stored; the aggregate
    is written in `scratch`, one update read back from the spool at a time. The manifest is
    written once (`ObjectStore.put_new`): a retry after a lost answer never re-dates it, and a
    lead never replaces a decision it published. Failures are logged: whether a manifest counts
    is read back like every node reads it (`wait_for_manifest`)."""
    applied = {u: uploads[u].body for u in manifest.uids}
    hotkeys = {e.uid: e.hotkey for e in manifest.entries}
    window = manifest.window
    try:
        publish_aggregate(
            store, run, window, manifest.validator_uid, keypair, applied, hotkeys, scratch  # type: ignore[arg-type]
        )  # fmt: skip
        if not may_publish(run, window, block_now()):
            log.error("window %d: the aggregate took too long: no manifest published", window)
            return
        publish_manifest(store, manifest, keypair)
    except ObjectExists:
        log.warning("window %d: a manifest of ours is already stored: it stands", window)
    except StoreError as exc:
        log.error("window %d: publishing the manifest failed: %s", window, exc)


@dataclass(frozen=True)
class Decider:
    """What a deciding validator decides with: its bucket and hotkey, the run, the model's spec,
    a scratch folder for the aggregate it writes, and the chain's clock."""

    store: ObjectStore
    run: RunConfig
    spec: ModelSpec
    keypair: Keypair
    scratch: Path
    chain: ChainTime


def propose(
    me: Decider,
    roster: Roster,
    checks: Mapping[int, PeerCheck],
    uploads: Mapping[int, Upload],
    fingerprint_start: str,
    admission: Admission,
) -> WindowManifest | None:
    """Publish our decision for the window (`publish_decision`) while the chain is before the
    last block to publish, unless a manifest of ours already stands (published before a
    restart: peers may have applied it). The manifest we built, or None."""
    bucket, run, window = _bucket(roster, me.keypair), me.run, roster.window
    if _own_manifest(run, window, bucket):
        log.warning("window %d: a manifest we published before a restart stands", window)
        return None
    if not may_publish(run, window, me.chain.block()):
        log.warning("window %d: too late to publish a manifest", window)
        return None
    manifest = lead_manifest(
        run, window, roster, checks, admission, bucket.uid, bucket.hotkey, fingerprint_start
    )
    publish_decision(me.store, run, me.keypair, manifest, uploads, me.scratch, me.chain.block)
    return manifest


def adopt(
    me: Decider,
    roster: Roster,
    uploads: Mapping[int, Upload],
    fingerprint_start: str,
    proposed: WindowManifest | None,
) -> Agreement:
    """Read the deciders' manifests as every node does and apply the one that counts
    (`wait_for_manifest`: the highest-ranked stored by the cutoff block's timestamp), or nothing;
    our published history then holds what we applied (`publish_history`)."""
    bucket, run, window = _bucket(roster, me.keypair), me.run, roster.window
    counted = wait_for_manifest(roster, run, window, me.chain)
    if counted is not None and counted == proposed:
        return own_agreement(proposed, uploads)
    if counted is None:
        why = f"none stored by block {manifest_cutoff_block(run, window)}"
        log.warning("window %d: no manifest (%s): the window applies nothing", window, why)
        agreed = Agreement({}, None, False, f"no manifest ({why}): nothing applied")
    else:
        agreed = follow(roster, uploads, counted, fingerprint_start, run, me.spec)
    if counted is None or counted.validator_uid != bucket.uid:  # else ours, published already
        publish_history(me.store, run, me.keypair, window, bucket.uid, agreed, uploads, me.scratch)
    return agreed


def _bucket(roster: Roster, keypair: Keypair) -> PeerBucket:
    """Our bucket among the roster's deciders; ValueError if we are not one."""
    for d in roster.deciders:
        if d.hotkey == keypair.ss58_address:
            return d
    raise ValueError("only a deciding validator decides: the roster names others")


def _own_manifest(run: RunConfig, window: int, me: PeerBucket) -> bool:
    """Whether we have a manifest stored for `window`; True if we cannot tell (the read back
    then decides)."""
    try:
        return published_manifest(run, window, me) is not None
    except StoreError as exc:
        log.error("window %d: cannot read our own manifest: %s", window, exc)
        return True


def publish_history(
    store: ObjectStore,
    run: RunConfig,
    keypair: Keypair,
    window: int,
    uid: int,
    agreed: Agreement,
    uploads: Mapping[int, Upload],
    scratch: Path,
) -> None:
    """Our published history of `window`: the exact bytes of the updates the window applied that
    we hold (an empty aggregate when it applied nothing), so a replay lands where we are."""
    ours = {u: uploads[u] for u in agreed.updates if u in uploads}
    applied = {u: up.body for u, up in ours.items() if up.body is not None}
    hotkeys = {u: ours[u].hotkey for u in applied}
    try:
        publish_aggregate(store, run, window, uid, keypair, applied, hotkeys, scratch)
    except StoreError as exc:
        log.error("window %d: publishing the aggregate failed: %s", window, exc)


def own_agreement(manifest: WindowManifest, uploads: Mapping[int, Upload]) -> Agreement:
    """Our own decision, which counts: its updates as we fetched and checked them."""
    updates = {u: uploads[u].fetched.update for u in manifest.uids}
    fp = manifest.fingerprint_start
    return Agreement(updates, manifest, False, "own manifest", fp)  # type: ignore[arg-type]


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
