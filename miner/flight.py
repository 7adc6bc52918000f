"""One window's exchange on a peer, kept in the air while the next window trains.

With ``run.outer.delay = 1`` (docs/training.md) a peer uploads window ``w``'s update, gathers the
selected peers' updates and agrees on the set while it trains ``w + 1``; with ``delay = 0`` the
same exchange runs inline. A `Flight` carries what the peer needs once the exchange is over: the
window, the fingerprint the window started from, and the signed bytes of our update (part of the
saved state: a restarted peer resumes the flight, `record`). Rank 0 runs the exchange
(`Route.exchange`); the other ranks of a multi-device peer carry no work. `result` joins the
exchange and re-raises whatever it raised.

While it runs, `Flight.step` says where the exchange is (`FlightStep`, in order): ``uploading``
our update, ``waiting for the gather block``, ``gathering`` the selected updates, ``waiting for
the manifest`` of the lead validator, ``agreeing`` on the window's set; then ``done`` (or
``failed``: `result` raises). The exchange enters each step itself (`Flight.enter`), only
forward; the peer's window log line and its metrics read it (`miner.metrics`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from codec.spec import ModelSpec
from node.runtime.clock import ChainClock
from node.runtime.phases import Phases
from node.window.consensus import Agreement, agree, wait_for_manifest, window_roster
from node.window.exchange import publish
from node.window.gather import Fetched, gather
from node.window.pooled import PooledExchange
from protocol.chain.base import Chain
from protocol.naming import update_key
from protocol.runconfig import RunConfig
from protocol.stores import ObjectStore, StoreError


class IllegalTransition(RuntimeError):
    """A step or state the exchange cannot reach from where it is (a bug in the peer's flow)."""


class FlightStep(StrEnum):
    """Where a window's exchange is, in the order it gets there (the module docstring)."""

    UPLOADING = "uploading"
    WAITING_FOR_GATHER_BLOCK = "waiting for the gather block"
    GATHERING = "gathering"
    WAITING_FOR_MANIFEST = "waiting for the manifest"
    AGREEING = "agreeing"
    DONE = "done"
    FAILED = "failed"


ORDER = list(FlightStep)
FINAL = (FlightStep.DONE, FlightStep.FAILED)


@dataclass(frozen=True)
class Exchanged:
    """What a window's exchange did: our upload, the gathered updates and the agreed set."""

    upload_bytes: int
    upload_s: float
    fetched: dict[int, Fetched]
    agreed: Agreement
    seconds: dict[str, float] = field(default_factory=dict)  # each phase of the exchange


Enter = Callable[[FlightStep], None]
"""How the exchange says it has reached a step (`Flight.enter`)."""


class Flight:
    """The exchange of one window (see the module docstring): ``work(enter)`` runs it."""

    def __init__(
        self,
        window: int,
        start_fp: str,
        data: bytes | None,
        work: Callable[[Enter], Exchanged] | None,
        background: bool,
    ) -> None:
        self.window, self.start_fp, self.data = window, start_fp, data
        self.step = FlightStep.UPLOADING if work is not None else FlightStep.DONE
        self._work = work
        self._result: Exchanged | None = None
        self._error: BaseException | None = None
        self._background = background
        self._thread: threading.Thread | None = None
        self._started = False

    def start(self) -> None:
        """Run the exchange: in the background, or here until it is over (``delay = 0``). The
        cycle starts it once it holds it as in the air (`ExchangeCycle.launch`), so that its
        state and step read right while it runs."""
        if self._started:
            raise IllegalTransition(f"the exchange of window {self.window} has started already")
        self._started = True
        if self._work is not None and self._background:
            self._thread = threading.Thread(
                target=self._run, name=f"exchange-w{self.window}", daemon=True
            )
            self._thread.start()
        elif self._work is not None:
            self._run()

    def _run(self) -> None:
        assert self._work is not None
        try:
            self._result = self._work(self.enter)
        except BaseException as exc:  # handed to the training thread by `result`
            self._error = exc
            self.step = FlightStep.FAILED
        else:
            self.step = FlightStep.DONE

    def enter(self, step: FlightStep) -> None:
        """The exchange has reached `step`: only forward, and nothing after its end."""
        if self.step in FINAL or ORDER.index(step) <= ORDER.index(self.step):
            raise IllegalTransition(
                f"the exchange of window {self.window} cannot go from {self.step} to {step}"
            )
        self.step = step

    def done(self) -> bool:
        """Whether `result` returns at once (the exchange has finished, or runs nowhere here)."""
        return self._started and (self._thread is None or not self._thread.is_alive())

    def result(self) -> Exchanged | None:
        """The exchange's outcome (None on a rank without work); waits for it if it runs."""
        if not self._started:
            raise IllegalTransition(f"the exchange of window {self.window} has not started")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result

    def record(self) -> dict[str, Any]:
        """What the peer's saved state keeps to resume this flight after a restart."""
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else None
        return {
            "window": self.window,
            "fingerprint": self.start_fp,
            "update": raw if raw is not None else torch.zeros(0, dtype=torch.uint8),
        }


@dataclass(frozen=True)
class Route:
    """Where rank 0's exchange goes: the run and its model, the chain and its clock, our bucket
    (under our uid and hotkey), the local buckets of a simulation and the decode workers; it
    logs as the peer (``log``)."""

    cfg: RunConfig
    spec: ModelSpec
    chain: Chain
    clock: ChainClock
    store: ObjectStore
    uid: int
    hotkey: str
    local_root: Path | None
    pooled: PooledExchange | None
    log: logging.Logger

    def exchange(
        self, window: int, data: bytes, start_fp: str, resume: bool, enter: Enter
    ) -> Exchanged:
        """Upload our update, then at the gather point fetch the selected updates and apply what
        the lead validator's manifest says (`node.window.consensus`), entering each step."""
        phases = Phases(window, self.log, "exchange of window")
        with phases("upload", f"{len(data):,} B"):  # a flight starts uploading
            upload_bytes, upload_s = self._publish(data, window, resume)
        gather_block = self.clock.gather_block(window)
        enter(FlightStep.WAITING_FOR_GATHER_BLOCK)
        with phases("wait for the gather block", f"block {gather_block}"):
            self.clock.wait_for_block(gather_block)
        enter(FlightStep.GATHERING)
        roster = window_roster(self.chain, self.cfg, window, self.local_root)
        peers = [roster.buckets[u] for u in roster.selected if u in roster.buckets]
        deadline = self.clock.deadline_s(window)
        with phases("gather", f"{len(peers)} selected"):
            fetched = gather(peers, self.cfg, self.spec, window, deadline, self.pooled)
        enter(FlightStep.WAITING_FOR_MANIFEST)
        with phases("wait for the manifest"):
            manifest = wait_for_manifest(roster, self.cfg, window, self.chain)
        enter(FlightStep.AGREEING)
        agreed = agree(roster, fetched, manifest, start_fp, self.cfg, self.spec)
        return Exchanged(upload_bytes, upload_s, fetched, agreed, phases.seconds)

    def _publish(self, data: bytes, window: int, resume: bool) -> tuple[int, float]:
        """Upload our update (a resumed exchange only if it is not stored yet)."""
        key = update_key(self.cfg.run_id, window, self.uid, self.hotkey)
        try:
            if resume and self.store.exists(key):
                return len(data), float("nan")
            done = publish(
                self.store, data, self.cfg, window, self.uid, self.hotkey,
                until=self.clock.deadline_s(window),
            )  # fmt: skip
        except StoreError as exc:  # keep training: a missed upload costs us one window's score
            self.log.error("window %d: upload failed: %s", window, exc)
            return len(data), float("nan")
        return done.n_bytes, done.seconds
