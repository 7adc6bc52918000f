"""Prometheus metrics of a peer: `node.runtime.metrics.NodeMetrics` (identity, window, progress,
phases: what the container health check reads) plus its training and exchange: loss,
throughput, bytes moved, gather success, how far behind the chain it is, and where its exchange
is now (`miner.exchange_cycle`: its state, and the step of the one in the air), read when
scraped."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Counter, Gauge

from miner.exchange_cycle import ExchangeCycle, ExchangeState
from miner.flight import FlightStep
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
        self.exchange_state = Gauge(
            "tessera_miner_exchange_state", "1 for the state the peer's exchange is in now",
            ["state"], registry=r,
        )  # fmt: skip
        self.exchange_step = Gauge(
            "tessera_miner_exchange_step", "1 for the step the exchange in the air is at now",
            ["step"], registry=r,
        )  # fmt: skip

    def watch(self, exchange: ExchangeCycle) -> None:
        """Serve `exchange`'s state and its flight's step as they are at each scrape (every
        state and step has a series: 1 for the current one, 0 for the others)."""
        for state in ExchangeState:
            now = _is(lambda: exchange.state, state)
            self.exchange_state.labels(state=state.value).set_function(now)
        for step in FlightStep:
            now = _is(lambda: exchange.step_in_the_air, step)
            self.exchange_step.labels(step=step.value).set_function(now)


def _is(read: Callable[[], object], value: object) -> Callable[[], float]:
    """1.0 while `read()` is `value`, else 0.0 (read at each scrape)."""
    return lambda: float(read() is value)
