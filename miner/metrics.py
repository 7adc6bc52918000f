"""Prometheus metrics of a peer: `node.runtime.metrics.NodeMetrics` (identity, window, progress,
phases: what the container health check reads) plus its training and exchange: loss,
throughput, bytes moved, gather success and how far behind the chain it is."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from node.runtime.metrics import NodeMetrics


class PeerMetrics(NodeMetrics):
    def __init__(self, window_seconds: float) -> None:
        super().__init__("miner", window_seconds)
        r = self.registry
        self.loss = Gauge(
            "tessera_miner_inner_loss", "mean inner loss of the last window", registry=r
        )
        self.tokens_per_s = Gauge(
            "tessera_miner_tokens_per_second", "inner training throughput", registry=r
        )
        self.bytes_up = Counter("tessera_miner_uploaded_bytes", "update bytes uploaded", registry=r)
        self.bytes_down = Counter(
            "tessera_miner_downloaded_bytes", "update bytes downloaded", registry=r
        )
        self.gather_ok = Gauge(
            "tessera_miner_gather_success_ratio", "fraction of selected updates used", registry=r
        )
        self.window_lag = Gauge(
            "tessera_miner_window_lag", "chain window minus the window just finished", registry=r
        )
