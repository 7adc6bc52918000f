"""One window's exchange on a peer, kept in the air while the next window trains.

With ``run.outer.delay = 1`` (docs/training.md) a peer uploads window ``w``'s update, gathers the
selected peers' updates and agrees on the set while it trains ``w + 1``; with ``delay = 0`` the
same exchange runs inline. A `Flight` carries what the peer needs once the exchange is over: the
window, the fingerprint the window started from, and the signed bytes of our update (part of the
saved state: a restarted peer resumes the flight, `record`). Rank 0 runs the exchange (upload,
gather, the lead's manifest, agreement); the other ranks of a multi-device peer carry no work.
`result` joins the exchange and re-raises whatever it raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from node.window.consensus import Agreement
from node.window.gather import Fetched


@dataclass(frozen=True)
class Exchanged:
    """What a window's exchange did: our upload, the gathered updates and the agreed set."""

    upload_bytes: int
    upload_s: float
    fetched: dict[int, Fetched]
    agreed: Agreement
    seconds: dict[str, float] = field(default_factory=dict)  # each phase of the exchange


class Flight:
    """The exchange of one window (see the module docstring)."""

    def __init__(
        self,
        window: int,
        start_fp: str,
        data: bytes | None,
        work: Callable[[], Exchanged] | None,
        background: bool,
    ) -> None:
        self.window, self.start_fp, self.data = window, start_fp, data
        self._work = work
        self._result: Exchanged | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if work is not None and background:
            self._thread = threading.Thread(
                target=self._run, name=f"exchange-w{window}", daemon=True
            )
            self._thread.start()
        elif work is not None:
            self._run()

    def _run(self) -> None:
        assert self._work is not None
        try:
            self._result = self._work()
        except BaseException as exc:  # handed to the training thread by `result`
            self._error = exc

    def done(self) -> bool:
        """Whether `result` returns at once (the exchange has finished, or runs nowhere here)."""
        return self._thread is None or not self._thread.is_alive()

    def result(self) -> Exchanged | None:
        """The exchange's outcome (None on a rank without work); waits for it if it runs."""
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
