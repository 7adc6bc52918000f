"""Prometheus metrics every node serves (`tessera miner` and `tessera validator`
`--metrics-port`): who it is, the last window it finished, when, how long a window lasts and
where the last window's time went, phase by phase.

Names follow Prometheus' conventions (base units in the name, ``_total`` on counters, one
``tessera_`` prefix, the role in the name only where a series is the role's own); identity is one
info series, ``tessera_node_info{role, uid, hotkey, run_id} 1``, so a dashboard joins on the
scrape target rather than repeating labels on every series. The endpoint listens on 127.0.0.1
unless told otherwise (`--metrics-host`): a container that publishes it sets ``0.0.0.0`` inside.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Gauge, start_http_server

__all__ = ["DEFAULT_HOST", "NodeMetrics"]

DEFAULT_HOST = "127.0.0.1"


class NodeMetrics:
    """One registry per node, so several nodes in one process (tests) do not collide."""

    def __init__(self, role: str, window_seconds: float) -> None:
        self.role = role
        self.registry = CollectorRegistry()
        r = self.registry
        self.info = Gauge(
            "tessera_node_info", "the node: role, uid, hotkey and run (value 1)",
            ["role", "uid", "hotkey", "run_id"], registry=r,
        )  # fmt: skip
        self.window = Gauge("tessera_window", "the last window the node finished", registry=r)
        self.progress = Gauge(
            "tessera_last_progress_timestamp_seconds",
            "when the node last finished a window (or started)",
            registry=r,
        )
        self.progress.set(time.time())
        self.window_length = Gauge(
            "tessera_window_length_seconds", "the run's window length", registry=r
        )
        self.window_length.set(window_seconds)
        self.phase = Gauge(
            "tessera_phase_seconds", "time the last window spent in each phase", ["phase"],
            registry=r,
        )  # fmt: skip

    def identify(self, uid: int, hotkey: str, run_id: str) -> None:
        self.info.labels(role=self.role, uid=str(uid), hotkey=hotkey, run_id=run_id).set(1)

    def finished(self, window: int, phases: Mapping[str, float]) -> None:
        """A window is done: its number, its phases' seconds, the time."""
        self.window.set(window)
        for name, seconds in phases.items():
            self.phase.labels(phase=name).set(seconds)
        self.progress.set(time.time())

    def serve(self, port: int, host: str = DEFAULT_HOST) -> None:
        start_http_server(port, addr=host, registry=self.registry)
