"""Prometheus metrics of a peer: loss, throughput, bytes moved, gather success, window lag, and
when it last finished a window (what the container health check reads)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server


class PeerMetrics:
    """One registry per peer, so several peers in one process (tests) do not collide."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.window = Gauge("tessera_window", "last completed window", registry=r)
        self.loss = Gauge("tessera_inner_loss", "mean inner loss of the last window", registry=r)
        self.tokens_per_s = Gauge(
            "tessera_tokens_per_second", "inner training throughput", registry=r
        )
        self.bytes_up = Counter("tessera_bytes_uploaded", "update bytes uploaded", registry=r)
        self.bytes_down = Counter("tessera_bytes_downloaded", "update bytes downloaded", registry=r)
        self.gather_ok = Gauge(
            "tessera_gather_success_ratio", "fraction of selected updates used", registry=r
        )
        self.window_lag = Gauge(
            "tessera_window_lag", "chain window minus the window just finished", registry=r
        )
        self.progress = Gauge(
            "tessera_last_progress_unixtime",
            "when the node last finished a window (or started)",
            registry=r,
        )
        self.progress.set(time.time())
        self.window_seconds = Gauge(
            "tessera_window_seconds", "the run's window length in seconds", registry=r
        )

    def serve(self, port: int) -> None:
        start_http_server(port, registry=self.registry)
