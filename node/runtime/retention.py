"""Bounded storage of our own bucket: old objects of ours are deleted after each window.

What is kept is the run config's `RetentionConfig` (`doomed` is the rule, a pure function):
every object of the newest ``windows`` windows; the newest checkpoint (with its manifest) and every
object since it, so a late joiner can always replay from it; older checkpoints thinned to the first
of each span of ``checkpoint_every_kept`` windows while younger than ``checkpoint_windows``.

`prune_own_bucket` applies it after each window, on every provider, by deleting: one listing of
our run's window objects (``{run_id}/w``, paginated by the store, at most `LIST_LIMIT` entries)
and at most `MAX_DELETES` deletions, oldest first, so a backlog drains over a few windows and a
prune never takes long. Nodes prune through `BackgroundPruner`, off the window's critical path: a
store that answers slowly (throttling, retries) never delays the next window's training or
decision, and a prune still running when the next is due is not doubled. Only names that parse
(`protocol.naming`) and carry our uid and hotkey are touched: never another run's objects, never
anything we do not recognise, and only ever our own bucket (the store opened with our write key).

`apply_lifecycle` adds, where the provider supports S3 lifecycle rules (R2, S3, MinIO), what a
deletion cannot do: abort multipart uploads left incomplete for a day (a crashed checkpoint upload
leaves parts that are billed but never listed) and expire object versions a day after they stop
being current (on a versioned bucket a deletion only hides an object). Age-based expiration of the
objects themselves is not used: lifecycle ages count in days while windows last minutes, and it
cannot tell a checkpoint that must be kept from one that may go.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from protocol.naming import NamingError, ObjectKey, ObjectKind, parse_key, run_prefix
from protocol.runconfig import RetentionConfig, RunConfig
from protocol.stores import ObjectStore, S3Store, StoreError

log = logging.getLogger(f"tessera.{__name__}")

MAX_DELETES = 1000
"""Deletions per prune; the rest waits for the next window."""
LIST_LIMIT = 100_000
"""The most objects of ours one prune lists (steady state: ``windows`` x a few per window)."""
CHECKPOINT_KINDS = (ObjectKind.CHECKPOINT, ObjectKind.MANIFEST)
RULE_PREFIX = "tessera-"
LIFECYCLE_RULES: tuple[dict[str, Any], ...] = (
    {
        "ID": "tessera-abort-incomplete-multipart",
        "Status": "Enabled",
        "Filter": {"Prefix": ""},
        "AbortIncompleteMultipartUpload": {"DaysAfterInitiation": 1},
    },
    {
        "ID": "tessera-expire-noncurrent-versions",
        "Status": "Enabled",
        "Filter": {"Prefix": ""},
        "NoncurrentVersionExpiration": {"NoncurrentDays": 1},
    },
)


@dataclass(frozen=True)
class Pruned:
    """What one prune did: objects deleted, objects of ours kept, deletions left for later."""

    deleted: int
    kept: int
    pending: int


def doomed(keys: Iterable[ObjectKey], rule: RetentionConfig, now: int) -> list[ObjectKey]:
    """The objects `rule` deletes once window `now` is done, oldest first."""
    keys = list(keys)
    checkpoints = sorted({k.window for k in keys if k.kind is ObjectKind.MANIFEST})
    floor = now - rule.windows + 1
    if checkpoints:
        floor = min(floor, checkpoints[-1])
    first_of_span: dict[int, int] = {}
    for window in checkpoints:
        first_of_span.setdefault(window // rule.checkpoint_every_kept, window)
    sparse = {w for w in first_of_span.values() if w > now - rule.checkpoint_windows}
    out = [
        k
        for k in keys
        if k.window < floor and not (k.kind in CHECKPOINT_KINDS and k.window in sparse)
    ]
    return sorted(out, key=lambda k: (k.window, k.render()))


def our_objects(store: ObjectStore, run: RunConfig, uid: int, hotkey: str) -> list[ObjectKey]:
    """Every window object of this run in `store` that names us as its writer."""
    found = []
    for info in store.list(f"{run_prefix(run.run_id)}w", limit=LIST_LIMIT):
        try:
            key = parse_key(info.key)
        except NamingError:
            continue
        if key.run_id == run.run_id and key.uid == uid and key.hotkey == hotkey:
            found.append(key)
    return found


def prune_own_bucket(
    store: ObjectStore,
    run: RunConfig,
    uid: int,
    hotkey: str,
    now: int,
    max_deletes: int = MAX_DELETES,
) -> Pruned | None:
    """Delete what `doomed` names (at most `max_deletes`); None, logged, if the store failed."""
    try:
        ours = our_objects(store, run, uid, hotkey)
        victims = doomed(ours, run.retention, now)
        for key in victims[:max_deletes]:
            store.delete(key.render())
    except StoreError as exc:  # our bucket failing costs storage, never the window
        log.warning("window %d: pruning our bucket failed: %s", now, exc)
        return None
    done = min(len(victims), max_deletes)
    if done:
        log.info("window %d: deleted %d old objects of ours (%d kept)", now, done, len(ours) - done)
    return Pruned(deleted=done, kept=len(ours) - done, pending=len(victims) - done)


LAST_PRUNE_WAIT_S = 60.0
"""How long a node that stops waits for its last prune (what it leaves, the next start prunes)."""


class BackgroundPruner:
    """`prune_own_bucket` of one node's bucket in a thread of its own, one prune at a time."""

    def __init__(self, store: ObjectStore, run: RunConfig, uid: int, hotkey: str) -> None:
        self._args = (store, run, uid, hotkey)
        self._thread: threading.Thread | None = None

    def start(self, now: int) -> bool:
        """Prune after window `now` in the background; False (nothing started) while the last
        prune still runs: the next window's prune takes up what it leaves."""
        if self._thread is not None and self._thread.is_alive():
            return False
        self._thread = threading.Thread(
            target=prune_own_bucket, args=(*self._args, now), name="prune", daemon=True
        )
        self._thread.start()
        return True

    def wait(self, timeout: float = LAST_PRUNE_WAIT_S) -> None:
        """Until the prune in progress, if any, has ended, or `timeout` seconds (a store that
        hangs never keeps a node from stopping: the thread is a daemon)."""
        if self._thread is not None:
            self._thread.join(timeout)


def apply_lifecycle(store: ObjectStore) -> bool:
    """Install `LIFECYCLE_RULES` on our S3 bucket, keeping every rule not named ``tessera-*``.

    True when the bucket has them (now or already); False for stores without lifecycle rules
    (``file://``) and providers or keys that refuse them (then deletion alone bounds the bucket).
    """
    if not isinstance(store, S3Store):
        return False
    try:
        current = store.lifecycle_rules()
        others = [r for r in current if not str(r.get("ID", "")).startswith(RULE_PREFIX)]
        wanted = [*others, *LIFECYCLE_RULES]
        if _same(current, wanted):
            return True
        store.set_lifecycle_rules(wanted)
    except StoreError as exc:
        log.info("lifecycle rules not applied to %s (%s): deletion alone bounds it", store, exc)
        return False
    log.info("lifecycle rules applied to %s", store.location)
    return True


def _same(current: list[dict[str, Any]], wanted: list[dict[str, Any]]) -> bool:
    """Whether the bucket already has exactly the wanted rules (a server may add fields)."""
    by_id = {str(r.get("ID")): r for r in current}
    if len(by_id) != len(current) or len(current) != len(wanted):
        return False
    return all(
        all(by_id.get(str(rule["ID"]), {}).get(k) == v for k, v in rule.items()) for rule in wanted
    )
