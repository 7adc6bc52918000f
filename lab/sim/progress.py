"""What a running simulation prints: one line per window the validator has finished (who was
applied, who was paid and how much, who was paid nothing and by which rule), with the time so
far and an estimate of the time left, so a long run is never silent."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from lab.sim.layout import World
from node.runtime.report_log import REPORTS, read_json_lines

__all__ = ["WindowLines", "window_line"]


def window_line(report: dict[str, Any], names: dict[int, str]) -> str:
    """One window of the validator's score report, as a line."""
    weights = {int(u): w for u, w in report["weights"].items()}
    paid = sorted(((w, u) for u, w in weights.items() if w > 0), reverse=True)
    unpaid = [p for p in report["peers"] if weights.get(p["uid"], 0.0) <= 0]

    def name(uid: int) -> str:
        return names.get(uid, f"uid {uid}")

    parts = [
        f"window {report['window']}: applied {len(report['aggregated'])} of "
        f"{len(report['selected'])} selected",
        "paid " + (", ".join(f"{name(u)} {w:.0%}" for w, u in paid) or "nobody"),
    ]
    if unpaid:
        why = ", ".join(f"{name(p['uid'])} ({p['rule'] or p['verdict']})" for p in unpaid)
        parts.append(f"paid nothing: {why}")
    return "; ".join(parts)


class WindowLines:
    """Call `tick` now and then: prints the lines of the windows finished since the last call."""

    def __init__(self, world: World, windows: int, emit: Callable[[str], None]) -> None:
        validators = world.of_kind("validator")
        self._path = validators[0].state_dir / REPORTS if validators else None
        self._names = {m.uid: m.name for m in world.members}
        self._windows, self._emit = windows, emit
        self._seen = 0
        self._started = time.monotonic()

    def tick(self) -> None:
        if self._path is None:
            return
        reports = read_json_lines(self._path)
        for report in reports[self._seen :]:
            self._emit(f"{window_line(report, self._names)}; {self._timing(len(reports))}")
        self._seen = max(self._seen, len(reports))

    def _timing(self, done: int) -> str:
        elapsed = time.monotonic() - self._started
        left = elapsed / done * max(0, self._windows - done) if done else float("nan")
        return f"{elapsed:.0f} s so far, about {left:.0f} s left"
