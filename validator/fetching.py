"""Fetch every peer's update (and its fingerprint) for a window, concurrently, never raising.

One `protocol.stores.fetch.fetch_many` call under the run's hard budget fetches every registered
peer's update and its published fingerprint of the previous window; a hung, dripping or refusing
endpoint costs at most the budget and is reported ``unreachable``. The window's selected updates
(the ones the lead's manifest needs), the other updates and the fingerprints are three pools with
their own connection slots, and the requests start in an order drawn afresh each window: a crowd
of registered hotkeys ahead in uid order whose buckets send just above the minimum rate cannot
keep the selected updates waiting, and holds the other slots for a fair share of the budget each,
not for all of it (`fetch_many`'s pools). Updates are then judged by
`node.window.gather.checked`, the very rule every honest peer applies (late rule, byte cap,
verify-then-decode), so the validator keeps exactly the set the peers keep; the exact bytes and
the object time come with each verified update.

Each update's body goes to a file in the window's spool directory while it arrives
(`protocol.stores.spool`, under the validator's state directory: `window_spool`), and a verified
update is kept as that file (`node.window.gather.StoredUpdate`): read back, checked against its
digest and decoded whenever it is used, one at a time. So the validator holds no peer's bytes
between uses, and its memory does not grow with the number of peers beyond the sketches.

What the checks need of each decoded update (its norm and sketch: `validator.classify.measure`)
is taken by `measure` while the update is decoded for its check, so the lead decodes each update
once before it publishes the window's manifest, which every peer is waiting for.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Any

from codec.spec import ModelSpec
from node.strategy.format import Decoded
from node.window.buckets import PeerBucket
from node.window.gather import Fetched, StoredUpdate, checked, fetch_all, update_request
from protocol.naming import fingerprint_key
from protocol.runconfig import RunConfig
from protocol.stores.fetch import FetchRequest, Got
from protocol.stores.spool import Body, remove_spool, spool_directory

log = logging.getLogger(f"tessera.{__name__}")

MAX_FINGERPRINT_BYTES = 4096
SPOOL = "spool"
"""The validator's spool, under its state directory: one subdirectory per window in progress."""


def clear_spool(state_dir: Path) -> None:
    """Remove whatever a crashed run left in the spool (at start-up)."""
    remove_spool(state_dir / SPOOL)


@contextlib.contextmanager
def window_spool(state_dir: Path, window: int) -> Iterator[Path]:
    """The window's empty spool directory, removed with its files when the window is done."""
    with spool_directory(state_dir / SPOOL / f"window-{window}") as path:
        yield path


@dataclass(frozen=True)
class Upload:
    """One peer's update for the window as fetched, plus its published fingerprint."""

    uid: int
    hotkey: str
    fetched: Fetched
    fingerprint: str | None  # the peer's published fingerprint for window - 1, if any
    keeps_clock: bool = False  # its provider stamps objects with its own clock
    measured: Any = None  # what `measure` took of the decoded update (`fetch_uploads`)

    @property
    def body(self) -> Body | None:
        """The exact bytes (only when they verified and decoded)."""
        return self.fetched.body

    @property
    def last_modified(self) -> datetime | None:
        return self.fetched.last_modified


def parse_fingerprint(got: object, run: RunConfig, window: int, uid: int) -> str | None:
    """A peer's published fingerprint body, strictly checked; None for anything else."""
    if not isinstance(got, Got):
        return None
    try:
        body = json.loads(got.data)
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("run_id") != run.run_id:
        return None
    if body.get("window") != window or body.get("uid") != uid:
        return None
    fp = body.get("fingerprint")
    return fp if isinstance(fp, str) and len(fp) <= 128 else None


def fetch_uploads(
    peers: Sequence[PeerBucket],
    run: RunConfig,
    spec: ModelSpec,
    window: int,
    deadline_s: float,
    spool: Path,
    measure: Callable[[int, Decoded], Any] | None = None,
    selected: Collection[int] = (),
) -> dict[int, Upload]:
    """Every peer's `Upload`, keyed by uid, within the run's fetch budget; update bodies go to
    files in `spool` (an empty directory that lives as long as the uploads are used). Each
    verified update is decoded once here, handed to `measure` (uid, decoded), and then kept as its
    body alone (`StoredUpdate`): one decoded update in memory at a time. The updates of the
    `selected` uids are fetched in a pool of their own."""
    requests: dict[tuple[int, str], FetchRequest] = {}
    pools: dict[Hashable, str] = {}
    for p in random.SystemRandom().sample(list(peers), len(peers)):  # an order nobody can plan for
        requests[(p.uid, "update")] = update_request(p, run, spec, window, spool)
        pools[(p.uid, "update")] = "selected" if p.uid in selected else "others"
        if window > 0:
            key = fingerprint_key(run.run_id, window - 1, p.uid, p.hotkey)
            requests[(p.uid, "fingerprint")] = FetchRequest(p.store, key, MAX_FINGERPRINT_BYTES)
            pools[(p.uid, "fingerprint")] = "fingerprints"
    got = fetch_all(requests, run, pools)
    out = {}
    for p in peers:
        fetched = checked(p.uid, p.hotkey, got[(p.uid, "update")], run, spec, window, deadline_s)
        measured = None
        if fetched.update is not None and fetched.body is not None:
            if measure is not None:
                measured = measure(p.uid, fetched.update)
            stored = StoredUpdate.of(fetched.update, fetched.body, run, spec)
            fetched = replace(fetched, update=stored)  # the decoded tensors go here
        fingerprint = parse_fingerprint(got.get((p.uid, "fingerprint")), run, window - 1, p.uid)
        out[p.uid] = Upload(p.uid, p.hotkey, fetched, fingerprint, p.keeps_clock, measured)
    return out
